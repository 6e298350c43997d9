"""Only the engine loop computes with the engine's threads.

llama.cpp's OpenMP build gives every thread that computes with several threads a team of
worker threads of its own, kept for the life of the process. Once a process holds more team
threads than cores, OpenMP stops spinning at ggml's barriers and sleeps at each one, and a
decode at 2 threads on 2 cores took 37 ms a token instead of 16 (SmolLM2): the engine's
constructor had measured its state size with a decode of its own, on its caller's thread.

Real llama.cpp, in a fresh process (counting its threads is exact only there).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton_serve.replicas.engine import ggml_backends

COUNT_THREADS = """
import json, os, sys
from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.cache_store.wire.sampling_params import SamplingParams

def threads():
    return len(os.listdir("/proc/self/task"))

ggml_backends.ensure_loaded()  # what loading the backends starts is not counted
before = threads()
config = EngineConfig(n_ctx=256, n_slots=1, n_threads=2, prefix_cache=False)
engine = Engine(sys.argv[1], config, hmac_key=b"test-cluster-key")
built = threads()
engine.generate(engine.text_prompt("Count the threads, please."), SamplingParams(max_tokens=4))
served = threads()
engine.close()
print(json.dumps({"before": before, "built": built, "served": served}))
"""


@pytest.mark.skipif(
    "OPENMP = 1" not in ggml_backends.system_info(), reason="llama.cpp built without OpenMP"
)
def test_building_an_engine_leaves_no_thread_team_behind(tiny_model) -> None:
    done = subprocess.run(
        [sys.executable, "-c", COUNT_THREADS, str(tiny_model("llama"))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])

    # Built: the engine loop's thread, nothing more (no OpenMP team of the builder's).
    assert counts["built"] == counts["before"] + 1, counts
    # Serving: the engine loop's team (one worker beside it, for two threads).
    assert counts["served"] == counts["built"] + 1, counts
