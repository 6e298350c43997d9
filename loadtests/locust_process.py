"""The project's locustfile run headless in a child process, as the benchmarks run it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@contextlib.contextmanager
def headless_locust(
    url: str, prefix: Path, users: int, spawn_rate: int, options: Sequence[str]
) -> Iterator[subprocess.Popen]:
    """Locust against `url` with `users` (started `spawn_rate` a second) and `options`
    (locustfile options, then user classes); its CSV and HTML reports are written at
    `prefix`, its output in `PREFIX_locust.log`. The caller stops it, or waits for it."""
    command = [
        *(sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", url, "--headless"),
        *("--users", str(users), "--spawn-rate", str(spawn_rate)),
        *("--csv", str(prefix), "--html", f"{prefix}.html", "--only-summary"),
        *options,
    ]
    root = LOCUSTFILE.parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with (
        locust_log(prefix).open("w") as output,
        subprocess.Popen(
            command, cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT
        ) as locust,
    ):
        yield locust


def locust_log(prefix: Path) -> Path:
    return prefix.parent / f"{prefix.name}_locust.log"


def locust_failed(locust: subprocess.Popen, prefix: Path) -> RuntimeError:
    """The error for a run that wrote none of what it should have: its exit and output."""
    tail = locust_log(prefix).read_text()[-2000:]
    return RuntimeError(f"locust failed (exit {locust.returncode}):\n{tail}")
