"""Benchmarks show where they are on stderr (never in `--json` stdout) and write PNG plots:
the progress reporter itself, and `baton bench engine|ship|index` run as subprocesses."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from plot_files import assert_png

from baton_serve.loadtests.progress import SILENT, Progress, clock


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _baton(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATON_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_progress_writes_plain_lines_with_an_eta() -> None:
    stream = io.StringIO()
    with Progress("bench x", stream) as progress:
        progress.step("loading")
        progress.start(4)
        progress.step("turn 1", done=1)
        progress.step("turn 4", done=4)
        progress.line("minute 1: 3 requests")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and all(line.startswith("[bench x 0:00] ") for line in lines)
    assert lines[0].endswith("] loading")
    assert lines[1].endswith("turn 1 (1/4, ETA 0:00)")
    assert lines[2].endswith("turn 4 (4/4)")  # nothing left: no ETA
    assert "\r" not in stream.getvalue()


def test_progress_rewrites_its_line_on_a_terminal() -> None:
    stream = _Terminal()
    with Progress("bench x", stream) as progress:
        progress.step("one")
        progress.step("two")
        progress.line("kept")
        progress.step("three")
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.count("\n") == 2  # "kept", and the close
    assert text.endswith("three\x1b[K\n")


def test_silent_progress_writes_nothing_and_clock_reads_well() -> None:
    SILENT.step("nothing", done=1)
    SILENT.line("nothing")
    SILENT.close()
    assert (clock(83.2), clock(3723)) == ("1:23", "1:02:03")


def test_bench_engine_shows_turns_on_stderr_and_plots_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _baton(
        "bench",
        "engine",
        "--model",
        "tiny:llama",
        "--turns",
        "2",
        "--system-tokens",
        "200",
        "--turn-tokens",
        "30",
        "--reply-tokens",
        "4",
        "--out",
        str(out),
        cache=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "[bench engine" in done.stderr and "[bench" not in done.stdout
    assert "speed run: prefill" in done.stderr and "(5/5)" in done.stderr
    assert "turn 2: computed" in done.stderr and "(2/2)" in done.stderr
    assert_png(out / "engine_turns.png")
    assert done.stdout.rstrip().endswith(f"wrote {out / 'engine_turns.png'}")


def test_bench_ship_pulls_instead_of_recomputing_in_one_json_object_with_a_plot(
    tmp_path: Path,
) -> None:
    """`bench ship` on a generated hybrid: each size's pull against recomputing, its stages
    adding up to the move; one JSON object on stdout, nothing else; the plot by size."""
    out = tmp_path / "out"
    done = _baton(
        "bench",
        "ship",
        "--model",
        "tiny:qwen35",
        "--tokens",
        "256",
        "1024",
        "--out",
        str(out),
        "--json",
        cache=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert [row["prefix_tokens"] for row in rows] == [256, 1024]
    assert "[bench" not in done.stderr  # silent with --json
    assert_png(out / "ship_vs_recompute.png")
    row = rows[1]
    assert row["cached_tokens"] == 1024
    assert row["computed_tokens_recompute"] == 1026
    assert row["state_bytes"] > 0
    # the move (asking the peer until the state is restored) and its stages, which add up
    assert 0 < row["move_s"] < row["ship_s"] and row["gb_per_s"] > 0
    stages = row["stages_s"]
    assert set(stages) == {"export", "transfer", "validate", "restore", "rest"}
    assert abs(sum(stages.values()) - row["move_s"]) < 1e-6
    assert all(stages[name] > 0 for name in ("transfer", "validate", "restore"))


def test_bench_index_shows_its_phases(tmp_path: Path) -> None:
    done = _baton("bench", "index", "--checkpoints", "500", "--lookups", "20", cache=tmp_path)
    assert done.returncode == 0, done.stderr
    for phase in ("redis: publishing 500", "redis: 20 lookups", "embedded: 20 lookups"):
        assert phase in done.stderr
    assert "[bench" not in done.stdout and "redis" in done.stdout


def test_bench_sampling_reports_rates_ratios_and_targets(tmp_path: Path) -> None:
    """`bench sampling` on a generated model: per-token sampling times, decode rates with the
    chain, the numpy baseline and a grammar, their ratios and the targets (values vary)."""
    done = _baton(
        "bench", "sampling", "--model", "tiny:llama", "--tokens", "6", "--runs", "1", "--json",
        cache=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["sample_us_per_token"]) == {"greedy", "temperature"}
    assert set(result["decode_tokens_per_s"]) == {
        "greedy", "temperature", "temperature_json_schema"
    }  # fmt: skip
    assert all(rate["median"] > 0 for rate in result["decode_tokens_per_s"].values())
    assert set(result["ratios"]) == {
        "chain_over_numpy_greedy", "chain_over_numpy_temperature", "json_schema_over_none"
    }  # fmt: skip
    assert set(result["targets"]) == {"chain_over_numpy >= 1.0", "json_schema_over_none >= 0.7"}
