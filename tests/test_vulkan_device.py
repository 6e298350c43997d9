"""Every layer of a generated model offloaded to a Vulkan device gives CPU's greedy tokens.

`make test` builds llama.cpp's Vulkan backend module (`deploy/vulkan_build.py`); on a machine
without a GPU its device is Mesa's software Vulkan driver (lavapipe), which ggml only uses
when named (`GGML_VK_VISIBLE_DEVICES=0`, set here unless already set). The device runs in a
child process, so this process's llama.cpp stays CPU-only and serves as the reference.

What is compared: the engine serves two turns of token-id prompts (150 tokens, then the
first turn's prompt and reply plus 20 more), then the first turn edited (the hybrid's slot
rewound to a resident partial state on the device), with `n_gpu_layers=-1` on the device and
with `n_gpu_layers=0` on CPU. On the device the engine decides its own defaults (exact reuse
off: no replay; flash attention left to llama.cpp), so the CPU reference keeps the decode's
state too. llama.cpp's own log must say every layer went to the device; the greedy token
ids of each turn (16 each) and the cached token counts must be equal. The device multiplies
in f16/f32 with other rounding than CPU's kernels: logits are not compared bit for bit, only
their argmax, which on these models is far from a tie.
"""

from __future__ import annotations

import ctypes
import json
import random
import re
import sys

import pytest
from lavapipe import child_report, skip_unless_device

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig

ARCHS = ("llama", "qwen35")
GREEDY = SamplingParams(max_tokens=16)
SETTINGS = {"n_ctx": 1024, "n_slots": 2, "n_threads": 2, "block_tokens": 16}
SETTINGS |= {"checkpoint_interval": 64, "prefill_chunk": 64}
GGML_DEVICE_GPU = 1  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL


def three_turns(engine: Engine) -> list[dict[str, object]]:
    """Two greedy turns of a conversation, then the first turn edited after 120 tokens (its
    slot rewound to the anchor at 64 where the model is hybrid: a resident state on the
    device); per turn its tokens, cached token count and whether the slot was rewound."""
    rng = random.Random(7)
    first = tuple(rng.randrange(3, engine.model.n_vocab) for _ in range(150))
    edited = first[:120] + tuple(rng.randrange(3, 1000) for _ in range(10))
    tokens, turns = first, []
    for turn in range(3):
        assert engine.wait_idle(60)  # the previous reply done (and replayed, where it is)
        done = engine.generate(Prompt(tokens=edited if turn == 2 else tokens), GREEDY)
        rewound = done.timings.rewound_bytes > 0
        turns.append(
            {"tokens": done.tokens, "cached": done.usage.cached_tokens, "rewound": rewound}
        )
        tokens += tuple(done.tokens) + tuple(rng.randrange(3, 1000) for _ in range(20))
    return turns


def gpu_devices() -> list[str]:
    """Descriptions of the GPU-type devices ggml registered in this process."""
    lib = ggml_backends.libggml
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    devices = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    return [
        lib.ggml_backend_dev_description(d).decode()
        for d in devices
        if lib.ggml_backend_dev_type(d) == GGML_DEVICE_GPU
    ]


def child(paths: list[str]) -> None:
    """Runs in the child: serve each model with every layer on the device; print JSON."""
    import llama_cpp

    from baton_serve.replicas.engine import llama_model

    llama_model._init_backend()
    log: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(_level: int, text: bytes, _user_data: object) -> None:
        log.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(keep, None)  # after the engine's own: it sees everything
    devices = gpu_devices()
    models: dict[str, object] = {}
    for path in paths if devices else []:
        log.clear()
        engine = Engine(path, EngineConfig(**SETTINGS, n_gpu_layers=-1), hmac_key=b"k")
        try:
            offloaded = re.findall(r"offloaded (\d+)/(\d+) layers", "".join(log))
            decided = {"exact_reuse": engine.config.exact_reuse}
            decided["flash_attn"] = engine.config.flash_attn
            models[path] = {"offloaded": offloaded, "decided": decided}
            models[path]["turns"] = three_turns(engine)
        finally:
            engine.close()
    print(json.dumps({"devices": devices, "models": models}))


@pytest.fixture(scope="module")
def on_device(tiny_model) -> dict[str, object]:
    """The child's report for every architecture (one child: the shaders compile once)."""
    report = child_report(__file__, *(str(tiny_model(arch)) for arch in ARCHS))
    skip_unless_device(",".join(report["devices"]) or "CPU")
    return report


@pytest.mark.parametrize("arch", ARCHS)
def test_every_layer_on_the_device_gives_cpu_greedy_tokens(
    arch, tiny_model, on_device, make_engine
) -> None:
    result = on_device["models"][str(tiny_model(arch))]
    ((offloaded, layers),) = result["offloaded"]
    assert offloaded == layers, f"{offloaded}/{layers} layers on {on_device['devices']}"

    assert result["decided"] == {"exact_reuse": False, "flash_attn": None}  # the device's
    cpu = three_turns(make_engine(tiny_model(arch), **SETTINGS, n_gpu_layers=0, exact_reuse=False))

    assert result["turns"] == cpu
    assert cpu[1]["cached"] > 150  # the second turn was served from the cache
    assert cpu[2]["cached"] == (64 if arch == "qwen35" else 120)  # the edit: an anchor, or cut
    assert cpu[2]["rewound"] is (arch == "qwen35")


if __name__ == "__main__":
    child(sys.argv[1:])
