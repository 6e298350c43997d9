"""What every `baton bench …` command shares: the model flag's help, progress on stderr, the
report (a table or JSON), and one line naming the `bench` extra when a package is missing."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

from baton_serve.loadtests.progress import Progress

BENCH_EXTRA_HINT = "pip install 'baton-serve[bench]'"
MODEL_HELP = "GGUF path, hf://ORG/REPO/FILE.gguf[@REV] or tiny:ARCH (default: SmolLM2)"


class MissingExtra(ValueError):
    """A benchmark needs a package of the `bench` extra that is not installed."""


def bench_progress(args: argparse.Namespace, bench: str) -> Progress:
    """Progress on stderr, silent with `--json`."""
    return Progress(f"bench {bench}", stream=None if args.json else sys.stderr)


def print_report(args: argparse.Namespace, result: dict, text: str, written: list[Path]) -> None:
    """`result` as JSON, or `text` and the files written."""
    print(json.dumps(result, indent=2) if args.json else text)
    if written and not args.json:
        print("wrote " + ", ".join(str(path) for path in written))


def needs_extra(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a missing optional package into one line naming the extra to install."""

    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] == "baton_serve":
                raise
            raise MissingExtra(
                f"this benchmark needs {exc.name!r}, from the bench extra: {BENCH_EXTRA_HINT}"
            ) from exc

    return checked
