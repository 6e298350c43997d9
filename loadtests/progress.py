"""Where a running benchmark is, on stderr: one line per step, so `--json` stdout stays one
object. On a terminal the step line is rewritten in place (`\\r`); elsewhere (a log, a
pipe) each step is a plain line. With the number of steps known, the line shows an ETA
from the pace so far."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def clock(seconds: float) -> str:
    """`83.2` → `1:23`; an hour or more → `1:02:03`."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


class Progress:
    """Steps of one benchmark named `name`, written to `stream` (None: silent)."""

    def __init__(self, name: str, stream: TextIO | None = sys.stderr) -> None:
        self._name = name
        self._stream = stream
        self._tty = bool(stream is not None and stream.isatty())
        self._open = False  # a step line waits to be rewritten (terminal only)
        self._started = self._phase_started = time.monotonic()
        self._total: int | None = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(self, total: int | None) -> None:
        """Count the steps that follow out of `total`; the ETA is measured from here."""
        self._total = total
        self._phase_started = time.monotonic()

    def step(self, text: str, done: int | None = None) -> None:
        """Show `text`; `done` steps of the current total are finished."""
        line = f"[{self._name} {clock(time.monotonic() - self._started)}] {text}"
        if done is not None and self._total:
            line += f" ({done}/{self._total}{self._eta(done)})"
        self._write(line, keep=False)

    def line(self, text: str) -> None:
        """A line that stays on a terminal too (a figure worth scrolling back to)."""
        self._write(f"[{self._name} {clock(time.monotonic() - self._started)}] {text}", keep=True)

    def close(self) -> None:
        """End a step line left open on a terminal."""
        if self._open and self._stream is not None:
            self._stream.write("\n")
            self._stream.flush()
        self._open = False

    def _eta(self, done: int) -> str:
        if not done or self._total is None or done >= self._total:
            return ""
        left = (time.monotonic() - self._phase_started) / done * (self._total - done)
        return f", ETA {clock(left)}"

    def _write(self, line: str, *, keep: bool) -> None:
        if self._stream is None:
            return
        if self._tty:
            width = shutil.get_terminal_size().columns - 1  # a wrapped line cannot be rewritten
            self._stream.write(f"\r{line[:width]}\x1b[K" + ("\n" if keep else ""))
            self._open = not keep
        else:
            self._stream.write(line + "\n")
        self._stream.flush()


SILENT = Progress("", stream=None)
