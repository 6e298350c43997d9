"""PNG plots of the benchmarks' results, drawn with matplotlib's Agg backend (no display).

`figure` holds the common frame (size, grid, legend, title, save, close); the functions
below draw one benchmark's figures each and return the paths written.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DPI = 120


@contextlib.contextmanager
def figure(path: Path, title: str, *, panels: int = 1) -> Iterator[list[Any]]:
    """Axes to draw on (one per panel, side by side); saved to `path` with a grid, legends
    and `title` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(7 if panels == 1 else 5.5 * panels, 4.5))
    axes = list(np.atleast_1d(axes))
    try:
        yield axes
        for ax in axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        if panels == 1:
            axes[0].set_title(title)
        else:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def engine_plots(result: dict, out_dir: Path) -> list[Path]:
    """Per turn: prompt tokens computed and TTFT, prefix cache on vs off."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "engine_turns.png"
    rows = result["turns"]
    turns = [r["turn"] for r in rows]
    with figure(
        path, f"Multi-turn chat, cache on vs off: {Path(result['model']).name}", panels=2
    ) as (
        tokens,
        ttft,
    ):
        tokens.plot(turns, [r["computed_tokens_no_cache"] for r in rows], "s-", label="cache off")
        tokens.plot(turns, [r["computed_tokens"] for r in rows], "o-", label="cache on")
        tokens.plot(turns, [r["new_tokens"] for r in rows], "k--", label="new tokens (ideal)")
        tokens.set(xlabel="turn", ylabel="prompt tokens computed", title="Computed tokens")
        ttft.plot(turns, [r["ttft_s_no_cache"] for r in rows], "s-", label="cache off")
        ttft.plot(turns, [r["ttft_s"] for r in rows], "o-", label="cache on")
        ttft.set(xlabel="turn", ylabel="time to first token (s)", title="TTFT")
        for ax in (tokens, ttft):
            ax.set_xticks(turns)
            ax.set_ylim(bottom=0)
    return [path]


def ship_plots(result: dict, out_dir: Path) -> list[Path]:
    """By prefix size (tokens and state MB): pulling the state from a peer vs recomputing it."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ship_vs_recompute.png"
    rows = result["rows"]
    x = np.arange(len(rows))
    with figure(path, f"Ship a prefix state vs recompute it: {Path(result['model']).name}") as (
        ax,
    ):
        ship = [r["ship_s"] for r in rows]
        ax.plot(x, [r["recompute_s"] for r in rows], "s-", label="recompute (cache off)")
        ax.plot(x, ship, "o-", label="ship (pull from a peer)")
        if all(r.get("move_s") for r in rows):
            ax.plot(x, [r["move_s"] for r in rows], "^:", label="state moved (export → restored)")
        for i, r in enumerate(rows):
            ax.annotate(f"ratio {r['ratio']:.3f}", (i, ship[i]), (8, -4), "data", "offset points")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        labels = [f"{r['prefix_tokens']} tok\n{r['state_bytes'] / 1e6:.3g} MB" for r in rows]
        ax.set_xticks(x, labels)
        ax.set_xlim(-0.5, len(rows) - 0.5)
        ax.margins(y=0.15)
        ax.set(xlabel="prefix (tokens / state size)", ylabel="request time (s, log scale)")
    return [path]


def soak_plots(
    rss: list[tuple[float, int, int]], windows: list[dict], warmup_s: float, out_dir: Path
) -> list[Path]:
    """Each replica's RSS over time (`rss`: seconds since the start, pid, bytes) and TTFT
    p50/p99 per minute (`windows`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rss_path, ttft_path = out_dir / "soak_rss.png", out_dir / "soak_ttft.png"
    by_pid: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for at, pid, size in rss:
        by_pid[pid].append((at, size))
    with figure(rss_path, "Replica resident memory (RSS) over the soak") as (ax,):
        for pid, series in sorted(by_pid.items()):
            ax.plot([t / 60 for t, _ in series], [b / 2**20 for _, b in series], label=f"pid {pid}")
        ax.axvline(warmup_s / 60, color="gray", linestyle=":", label="end of warm-up")
        ax.set(xlabel="time (min)", ylabel="RSS (MiB)")
    minutes = [w["minute"] for w in windows]
    with figure(ttft_path, "Time to first token per minute of the soak") as (ax,):
        for key, label, marker in (("ttft_p50_s", "p50", "o-"), ("ttft_p99_s", "p99", "s-")):
            ax.plot(
                minutes,
                [w[key] if w[key] is not None else np.nan for w in windows],
                marker,
                label=label,
            )
        failed = [w["minute"] for w in windows if w["failures"]]
        if failed:
            ax.plot(failed, [0] * len(failed), "rx", markersize=10, label="minute with failures")
        ax.set_xticks(minutes)
        ax.set(xlabel="minute", ylabel="TTFT (s)")
        ax.set_ylim(bottom=0)
    return [rss_path, ttft_path]


SIM_METRICS = {  # summary key -> (file name, axis label, log scale)
    "ttft_p50_s": ("sim_ttft_p50.png", "TTFT p50 (s, log scale)", True),
    "ttft_p99_s": ("sim_ttft_p99.png", "TTFT p99 (s, log scale)", True),
    "cache_hit_ratio": ("sim_cache_hit.png", "prompt tokens reused / prompt tokens", False),
    "computed_over_new": ("sim_computed_over_new.png", "computed / new prompt tokens", False),
    "load_imbalance": ("sim_load_imbalance.png", "max / mean replica work", True),
    "shipped_gb": ("sim_shipped.png", "state shipped between replicas (GB)", False),
}


def sim_plots(result: dict, out_dir: Path) -> list[Path]:
    """One PNG per metric of `baton bench sim`: each policy's figure by replica count."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in result["sizes"]]
    policies = list(next(iter(result["sizes"].values())))
    written = []
    for key, (name, label, log) in SIM_METRICS.items():
        path = out_dir / name
        title = f"Simulated cluster ({result['profile']['name']} profile): {label.split(' (')[0]}"
        with figure(path, title) as (ax,):
            for policy in policies:
                values = [result["sizes"][str(n)][policy][key] for n in sizes]
                ax.plot(sizes, values, "o-", label=policy)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            if log:
                ax.set_yscale("log")
            ax.set(xlabel="replicas", ylabel=label)
        written.append(path)
    return written


def emulated_plots(result: dict, out_dir: Path) -> list[Path]:
    """`bench routing --engine emulated`: each policy's TTFT CDF, the real system on emulated
    engines (solid) beside the simulator on the same workload (dashed, where it kept them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"emulated-{result['replicas']}_ttft_cdf.png"
    slowdown = result.get("slowdown", 1.0)
    clock = f", clock {slowdown:g}x slower" if slowdown != 1 else ""
    title = f"{result['replicas']} emulated replicas ({result['profile']['name']} profile{clock})"
    with figure(path, f"{title}\nTTFT: real system (solid), simulator (dashed)") as (ax,):
        for policy, pair in result["policies"].items():
            measured = [r["ttft_s"] for r in pair["emulated"].get("records", ())]
            line = cdf(ax, [t for t in measured if t is not None], label=policy)
            simulated = pair["simulated"].get("ttfts_s")
            if simulated and line is not None:
                cdf(ax, simulated, color=line.get_color(), linestyle="--")
        ax.set_xscale("log")
        ax.set(xlabel="time to first token (s, log scale)", ylabel="share of requests")
    return [path]


def cdf(ax: Any, values: list[float], **style: Any) -> Any:
    """Draw the empirical CDF of `values` on `ax` as a step; its line, or None where there
    is nothing to draw."""
    if not values:
        return None
    ordered = sorted(values)
    (line,) = ax.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post", **style)
    return line
