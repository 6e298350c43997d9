"""Start-up stages of replicas (loading the model, connecting to the index, ready), for a
command that starts them to show.

A replica given a folder writes its current stage to `<folder>/<replica id>.json`
(`baton serve` gives one to the replicas of the local cluster it starts).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def report_stage(folder: str | None, replica_id: str, stage: str) -> None:
    """Record in `folder`, if any, that `replica_id` has reached `stage` (never fails the
    replica)."""
    if not folder:
        return
    path = Path(folder) / f"{replica_id}.json"
    partial = path.with_suffix(".partial")
    try:
        partial.write_text(json.dumps({"stage": stage, "at": time.time()}))
        partial.replace(path)
    except OSError:
        pass


def read_stages(folder: str | os.PathLike[str]) -> dict[str, tuple[str, float]]:
    """Each replica's latest stage and when it was reached (epoch seconds)."""
    stages = {}
    for path in Path(folder).glob("*.json"):
        try:
            record = json.loads(path.read_text())
            stages[path.stem] = (str(record["stage"]), float(record["at"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return stages
