"""Every list of benchmarks a reader meets names what `baton bench --help` lists: the README's
command table, the Makefile's `make bench`, and the sections of docs/benchmarks.md.

The benches are read from the command line's own argparse parser (the one `baton` runs, with
`bench` registered through its entry point), not from a list kept here.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from baton_serve.deploy import cli

ROOT = Path(__file__).resolve().parent.parent


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands, in the order its `--help` lists them."""
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _bench_parser() -> argparse.ArgumentParser:
    return _subcommands(cli._parser())["bench"]


def bench_names() -> list[str]:
    """The benchmarks `baton bench --help` lists, in its order."""
    return list(_subcommands(_bench_parser()))


def readme_bench_list(readme: str) -> list[str]:
    """The names in the README command table's `baton bench …` row."""
    (row,) = (line for line in readme.splitlines() if line.startswith("| `baton bench …` |"))
    listed = row.split("|")[2].split(":")[0]
    return re.findall(r"`([a-z]+)`", listed)


def make_variables(makefile: str) -> dict[str, str]:
    """`NAME ?= value` (and `=`, `:=`) assignments of the Makefile."""
    found = re.findall(r"^([A-Z_]+)\s*[?:]?=[ \t]*(.*)$", makefile, flags=re.M)
    return dict(found)


def make_bench_commands(makefile: str) -> list[list[str]]:
    """The arguments after `baton` of each `baton bench` line of the `bench` target's recipe,
    its make variables expanded."""
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert recipe, "no bench target in the Makefile"
    variables = make_variables(makefile)
    commands = []
    for line in recipe.group(1).splitlines():
        line = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
        words = shlex.split(line)
        if len(words) > 1 and words[0].endswith("/baton") and words[1] == "bench":
            commands.append(words[1:])
    return commands


def test_the_bench_list_is_read_from_the_help_baton_prints() -> None:
    names = bench_names()
    help_text = _bench_parser().format_help()
    assert len(names) >= 10
    for name in names:
        assert re.search(rf"^\s+{name}\s", help_text, flags=re.M), name


def test_the_readme_lists_every_bench_in_the_order_of_its_help() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme_bench_list(readme) == bench_names()


def test_the_readme_names_no_bench_that_is_not_there() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"baton bench ([a-z]+)\b", readme))
    assert named <= set(bench_names()), named - set(bench_names())


def test_make_bench_runs_every_bench_and_each_line_parses() -> None:
    commands = make_bench_commands((ROOT / "Makefile").read_text())
    run = [command[1] for command in commands]
    assert set(run) == set(bench_names()), set(bench_names()) ^ set(run)
    first_runs = list(dict.fromkeys(run))
    assert first_runs == bench_names(), "make bench runs them in --help's order"
    parser = cli._parser()
    for command in commands:
        try:
            parser.parse_args(command)
        except SystemExit:
            pytest.fail(f"make bench passes flags baton refuses: {' '.join(command)}")


def test_the_results_page_has_a_section_for_each_bench_in_order() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.findall(r"^## `baton bench ([a-z]+)`", page, flags=re.M)
    assert sections == bench_names()


def test_a_stale_list_is_caught() -> None:
    """The readers above fail on a list that drops or reorders a bench (a mutation check)."""
    readme = (ROOT / "README.md").read_text()
    names = bench_names()
    row = next(line for line in readme.splitlines() if line.startswith("| `baton bench …` |"))
    dropped = readme.replace(row, row.replace(f", `{names[-1]}`", ""))
    assert readme_bench_list(dropped) != names
    makefile = (ROOT / "Makefile").read_text()
    without = re.sub(rf"^\t\S+/baton bench {names[0]}\b.*\n", "", makefile, flags=re.M)
    assert {c[1] for c in make_bench_commands(without)} != set(names)
