"""A CSV of locust samples written as they come: `PREFIX_NAME.csv.part` during a local run with
`--csv PREFIX`, renamed to `PREFIX_NAME.csv` when locust quits. Benchmarks read the `.part`
file for figures while the run goes on, and the whole file after it."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable
from typing import IO, Any

from locust import events
from locust.runners import MasterRunner, WorkerRunner


class SampleLog:
    """One CSV file of rows with `fields`; `write` does nothing unless the run keeps samples
    (`--csv` given, a local run: a distributed run's samples are on its workers)."""

    def __init__(self, name: str, fields: Iterable[str]) -> None:
        self._name = name
        self._fields = tuple(fields)
        self._file: IO[str] | None = None
        self._writer: Any = None
        events.test_start.add_listener(self._open)
        events.quitting.add_listener(self._close)

    def write(self, row: Iterable[object]) -> None:
        if self._writer is not None:
            self._writer.writerow(tuple(row))
            self._file.flush()  # a reader of the .part file sees whole lines

    def _open(self, environment, **_kwargs) -> None:
        prefix = getattr(environment.parsed_options, "csv_prefix", None)
        if not prefix or isinstance(environment.runner, (MasterRunner, WorkerRunner)):
            return
        self._file = open(f"{prefix}_{self._name}.csv.part", "w", newline="")  # noqa: SIM115
        self._writer = csv.writer(self._file)
        self._writer.writerow(self._fields)

    def _close(self, **_kwargs) -> None:
        if self._file is not None:
            part, self._file, self._writer = self._file, None, None
            part.close()
            os.replace(part.name, part.name.removesuffix(".part"))
