"""The floor under a shipped state: Ray's object store alone moving the same bytes.

One actor returns a uint8 array of `nbytes` (as a replica's `export_best` returns a state,
Ray copying it into the object store) to another actor that reads every byte of it (as the
validation does); both pinned like the replicas they stand for. The first trip is timed
apart: its pages are new to the store and to both processes (page faults); later trips
reuse them, as a long-running replica's do.
"""

from __future__ import annotations

import time

import numpy as np
import ray

TRIPS = 5


@ray.remote(num_cpus=0)
class _Source:
    def __init__(self, nbytes: int) -> None:
        self.array = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)

    def array_out(self) -> np.ndarray:
        return self.array


@ray.remote(num_cpus=0)
class _Sink:
    async def trips(self, source, n: int) -> list[float]:
        seconds = []
        for _ in range(n):
            started = time.perf_counter()
            array = await source.array_out.remote()
            int(np.bitwise_xor.reduce(array[::4096]))  # touch every page, as a hash would
            seconds.append(time.perf_counter() - started)
            del array
        return seconds


def object_store_floor(
    nbytes: int, source_resources: dict | None = None, sink_resources: dict | None = None
) -> dict:
    """Seconds of the first trip of `nbytes` through the object store, the median of the
    next ones, and GB/s for each."""
    source = _Source.options(resources=source_resources or {}).remote(nbytes)
    sink = _Sink.options(resources=sink_resources or {}).remote()
    try:
        first, *rest = ray.get(sink.trips.remote(source, TRIPS))
    finally:
        ray.kill(source)
        ray.kill(sink)
    warm = float(np.median(rest))
    return {
        "nbytes": nbytes,
        "first_s": first,
        "warm_s": warm,
        "first_gb_per_s": nbytes / first / 1e9,
        "warm_gb_per_s": nbytes / warm / 1e9,
    }
