"""`baton bench disk --startup-gib`: a small run on real files, cleaned up after."""

from __future__ import annotations

from pathlib import Path

from baton_serve.loadtests.disk_startup_bench import format_startup_report, startup_benchmark


def test_startup_bench_adopts_every_file_it_wrote_and_deletes_them(tmp_path: Path) -> None:
    result = startup_benchmark([0.0625, 0.125], root=str(tmp_path))  # 1, then 2 files
    assert [row["files"] for row in result["rows"]] == [1, 2]  # each valid, adopted
    assert all(row["start_s"] > 0 and row["full_validation_s"] > 0 for row in result["rows"])
    assert list(tmp_path.iterdir()) == []
    assert "start s" in format_startup_report(result)
