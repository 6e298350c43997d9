"""Device memory is budgeted: a config is measured before it loads and refused with the
numbers where it cannot fit.

On the Vulkan lavapipe device (Mesa's software driver; ggml uses it when
`GGML_VK_VISIBLE_DEVICES=0` names it), in a child process so this process's llama.cpp stays
CPU-only: a config that fits starts, and what `device_memory.measure` said it needs on the
device is within ESTIMATE_FACTOR of the buffers llama.cpp then allocated there (its own log
lines: model, KV, RS and compute buffers on Vulkan0); configs that cannot fit (many slots
of a long context; a small share of the device) are refused before a context is created,
with the numbers, and the same process then serves a config that fits.
"""

from __future__ import annotations

import json
import re
import sys

import llama_cpp
import pytest
from lavapipe import DEVICE_ENV, child_report, require_vulkan_module, skip_unless_device

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine import device_memory
from baton_serve.replicas.engine.device_memory import MIB, budget_bytes
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.model_check import ModelCheckFailed, check_model
from baton_serve.replicas.models.tiny_model import write_tiny_model

ESTIMATE_FACTOR = 1.25  # measured before / allocated after, either way
FITS = {"n_ctx": 1024, "n_slots": 2, "n_threads": 2, "n_gpu_layers": -1}
# 16 layers x 128 bytes of f16 K+V per token x 8192 tokens x 256 slots: 4 GiB of KV cache,
# twice what lavapipe reports.
TOO_MANY_SLOTS = FITS | {"n_ctx": 8192, "n_slots": 256}
_BUFFER = re.compile(r"(\S+) (model|KV|RS|compute) buffer size =\s*([\d.]+) MiB")


def _engine_or_refusal(path: str, settings: dict[str, int]) -> dict[str, object]:
    """Start an engine with `settings` and greedy-decode 4 tokens, or say why it was refused."""
    try:
        engine = Engine(path, EngineConfig(**settings), hmac_key=b"k")
    except device_memory.DeviceMemoryError as exc:
        return {"refused": str(exc)}
    try:
        done = engine.generate(Prompt(tokens=(1, 5, 9, 13)), SamplingParams(max_tokens=4))
        return {"tokens": list(done.tokens)}
    finally:
        engine.close()


def child(path: str, big_path: str) -> None:
    """Runs in the child (lavapipe visible): print what was measured, allocated, refused."""
    from baton_serve.replicas.engine import ggml_backends, llama_model

    llama_model._init_backend()
    if not ggml_backends.offload_devices():
        print(json.dumps({"devices": []}))
        return
    log: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(_level: int, text: bytes, _user_data: object) -> None:
        log.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(keep, None)
    report: dict[str, object] = {"devices": ggml_backends.offload_devices()}
    (need,) = device_memory.measure(path, EngineConfig(**FITS))
    report["measured"] = need.__dict__
    report["fits"] = _engine_or_refusal(path, FITS)
    allocated: dict[str, float] = {}
    for device, kind, mib in _BUFFER.findall("".join(log)):
        if device == need.device:
            allocated[kind] = allocated.get(kind, 0.0) + float(mib) * MIB
    report["allocated"] = allocated
    report["too_many_slots"] = _engine_or_refusal(big_path, TOO_MANY_SLOTS)
    try:
        device_memory.check_fits(path, EngineConfig(**FITS), share=0.01)
        report["small_share"] = "accepted"
    except device_memory.DeviceMemoryError as exc:
        report["small_share"] = str(exc)
    report["fits_after"] = _engine_or_refusal(path, FITS)  # the process still serves
    print(json.dumps(report))


@pytest.fixture(scope="module")
def on_lavapipe(tiny_model, tmp_path_factory) -> dict[str, object]:
    require_vulkan_module()
    big = write_tiny_model("llama", tmp_path_factory.mktemp("deep") / "llama16.gguf", n_layers=16)
    report = child_report(__file__, str(tiny_model("qwen35")), str(big))
    skip_unless_device(",".join(report["devices"]) or "CPU")
    return report


def test_a_config_that_fits_starts_and_the_estimate_matches_the_allocation(on_lavapipe) -> None:
    measured, allocated = on_lavapipe["measured"], on_lavapipe["allocated"]
    assert len(on_lavapipe["fits"]["tokens"]) == 4
    assert measured["total"] > 0 and measured["free"] > 0  # lavapipe reports its heap
    parts = {"model": "weights", "KV": "kv_cache", "RS": "recurrent", "compute": "compute"}
    for kind, field in parts.items():  # the hybrid model has every part on the device
        assert measured[field] > 0, field
        ratio = measured[field] / allocated[kind]
        assert 1 / ESTIMATE_FACTOR <= ratio <= ESTIMATE_FACTOR, (field, measured, allocated)


def test_a_config_that_cannot_fit_is_refused_with_the_numbers(on_lavapipe) -> None:
    message = on_lavapipe["too_many_slots"]["refused"]
    for text in ("n_ctx=8192", "n_slots=256", "n_gpu_layers=-1", "KV cache", "MiB free of"):
        assert text in message, message
    assert "compute buffer" in message and "Lower n_ctx" in message
    assert len(on_lavapipe["fits_after"]["tokens"]) == 4  # refused, and the process serves


def test_a_replica_gets_its_share_of_a_shared_device(on_lavapipe) -> None:
    message = on_lavapipe["small_share"]
    assert "0.01 of the device" in message and "num_gpus_per_replica" in message, message


def test_baton_serves_start_check_refuses_what_cannot_fit(on_lavapipe, tmp_path) -> None:
    """The check `baton serve` runs before deploying measures the replicas' engine config."""
    big = write_tiny_model("llama", tmp_path / "llama16.gguf", n_layers=16)
    with pytest.raises(ModelCheckFailed, match="does not fit") as refused:
        check_model(big, n_gpu_layers=-1, env=DEVICE_ENV, engine=EngineConfig(**TOO_MANY_SLOTS))
    assert "n_slots=256" in str(refused.value)
    fits = check_model(big, n_gpu_layers=-1, env=DEVICE_ENV, engine=EngineConfig(**FITS))
    assert fits.device.startswith("Vulkan0")


def test_budget_is_the_share_of_the_device_never_more_than_is_free() -> None:
    total = 80 << 30
    assert budget_bytes(total, total, 1.0) == int(total * 0.95)
    assert budget_bytes(total, total, 0.5) == int(total * 0.5 * 0.95)
    assert budget_bytes(10 << 30, total, 0.5) == int((10 << 30) * 0.95)  # the others' use


def test_a_cpu_config_is_never_measured(tiny_model, make_engine) -> None:
    path = tiny_model("llama")
    assert device_memory.check_fits(path, EngineConfig(**FITS | {"n_gpu_layers": 0})) == []
    # This process has no GPU device: layers asked for run on the CPU, nothing is measured.
    assert device_memory.check_fits(path, EngineConfig(**FITS)) == []
    assert make_engine(path, n_gpu_layers=-1).model.device == "CPU"
    assert device_memory.ray_gpu_share() == 1.0  # no Ray actor here: the whole device


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
