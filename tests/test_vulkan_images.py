"""A conversation with an image, every layer and the projector on a Vulkan device (lavapipe
here, as in `test_vulkan_device.py`): the same greedy replies and cached counts as on CPU,
the image encoded once. The projector runs where the model's layers are (`use_gpu`).

qwen35 with Qwen3-VL's merger: M-RoPE's 2-D positions are the device path images add
(llama's one position a token is the text path `test_vulkan_device.py` runs, and its LLaVA
projector is checked on CPU in `test_images.py`). On the device the engine decides its own
defaults (no replay: the decode's state is kept), so the CPU reference keeps the decode's
state too. The device rounds differently from CPU's kernels, so only greedy token ids are
compared."""

from __future__ import annotations

import json
import sys

import pytest
from lavapipe import child_report, skip_unless_device
from media_inputs import asking, chat_prompt
from test_vulkan_device import gpu_devices

from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.prompt_builder import PromptBuilder

ARCHS = ("qwen35",)
GREEDY = SamplingParams(max_tokens=12)
SETTINGS = {"n_ctx": 1024, "n_slots": 2, "n_threads": 2, "block_tokens": 16}


def two_turns(model: str, mmproj: str, **settings: object) -> dict[str, object]:
    """A turn opening with an image, then a follow-up: each turn's tokens and cached count,
    and how many times the image was encoded."""
    config = EngineConfig(**SETTINGS, **settings)
    builder = PromptBuilder(model, block_tokens=16, n_ctx=1024, mmproj=mmproj)
    engine = Engine(model, config, hmac_key=b"k", mmproj=mmproj)
    try:
        messages = [asking(11)]
        turns = []
        for follow_up in ("What else?", None):
            done = engine.generate(chat_prompt(builder, messages), GREEDY)
            turns.append({"tokens": done.tokens, "cached": done.usage.cached_tokens})
            assert engine.wait_idle(60)
            if follow_up:
                messages += [
                    {"role": "assistant", "content": done.text},
                    {"role": "user", "content": follow_up},
                ]
        return {"turns": turns, "encoded": engine.stats.images_encoded}
    finally:
        engine.close()
        builder.close()


def child(pairs: list[str]) -> None:
    """Runs in the child: each `model=mmproj` pair on the device; prints JSON."""
    from baton_serve.replicas.engine import llama_model

    llama_model._init_backend()
    devices = gpu_devices()
    runs = {}
    for pair in pairs if devices else []:
        model, mmproj = pair.split("=")
        runs[model] = two_turns(model, mmproj, n_gpu_layers=-1)
    print(json.dumps({"devices": devices, "runs": runs}))


@pytest.fixture(scope="module")
def on_device(tiny_model, tiny_projector) -> dict[str, object]:
    pairs = [f"{tiny_model(arch)}={tiny_projector(arch)}" for arch in ARCHS]
    report = child_report(__file__, *pairs)
    skip_unless_device(",".join(report["devices"]) or "CPU")
    return report


@pytest.mark.parametrize("arch", ARCHS)
def test_an_image_on_the_device_gives_cpu_greedy_tokens(
    arch, tiny_model, tiny_projector, on_device
) -> None:
    model, mmproj = str(tiny_model(arch)), str(tiny_projector(arch))
    cpu = two_turns(model, mmproj, n_gpu_layers=0, exact_reuse=False)
    assert on_device["runs"][model] == cpu
    assert cpu["encoded"] == 1 and cpu["turns"][1]["cached"] > cpu["turns"][0]["cached"]


if __name__ == "__main__":
    child(sys.argv[1:])
