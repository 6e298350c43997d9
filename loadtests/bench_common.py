"""What every `baton bench …` command shares: the model flag's help, argparse types for
counts, speeds and sizes, progress on stderr, the report (a table or JSON), and one line
naming the `bench` extra when a package is missing."""

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


def _number(text: str, kind: type[int] | type[float], least: float, inclusive: bool) -> float:
    """`text` as a `kind` no smaller than `least` (equal only if `inclusive`), or argparse's
    error naming what is wrong."""
    try:
        value = kind(text)
    except ValueError:
        noun = "whole number" if kind is int else "number"
        raise argparse.ArgumentTypeError(f"{text!r} is not a {noun}") from None
    if value < least or (value == least and not inclusive):
        bound = f"at least {least:g}" if inclusive else f"more than {least:g}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value:g}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    return int(_number(text, int, 1, inclusive=True))


def non_negative_int(text: str) -> int:
    """argparse type: a whole number of at least 0 (a budget that may be off)."""
    return int(_number(text, int, 0, inclusive=True))


def positive_float(text: str) -> float:
    """argparse type: a number above 0 (a speed, a size)."""
    return _number(text, float, 0, inclusive=False)


def factor(text: str) -> float:
    """argparse type: a factor of at least 1 (a slowdown)."""
    return _number(text, float, 1, inclusive=True)


def non_negative_float(text: str) -> float:
    """argparse type: a number of at least 0 (a latency, a noise)."""
    return _number(text, float, 0, inclusive=True)


def number_list(kind: type[int] | type[float]) -> Callable[[str], tuple[float, ...]]:
    """argparse type: numbers of `kind`, each above 0, separated by commas (`2048,8192`)."""
    noun = "whole numbers" if kind is int else "numbers"

    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(kind(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{noun} separated by commas, got {text!r}") from None
        if min(values) <= 0:
            raise argparse.ArgumentTypeError(f"every one must be above 0, got {text!r}")
        return values

    return parse
