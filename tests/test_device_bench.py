"""`baton bench device`: every figure, on the Vulkan device (lavapipe) and on the CPU.

The device run is a child process (ggml uses lavapipe only when `GGML_VK_VISIBLE_DEVICES`
names it before it loads, and this process's llama.cpp stays CPU-only, as in
tests/test_vulkan_device.py); it also shows the bench imports nothing of Ray, Redis or
locust. The CPU run goes through the command line in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from lavapipe import child_report, skip_unless_device

from baton_serve.deploy.cli import main
from baton_serve.loadtests.device_bench import SHORT_REPLY, DeviceSettings, device_benchmark
from baton_serve.loadtests.device_report import format_report
from baton_serve.loadtests.peer_workload import PeerWorkload

CONTEXTS = (160, 256)
REPEATS = 2
DECODE_TOKENS = 8  # lavapipe compiles a pipeline per batch shape: keep the decode part short
STREAMS = (1, 2)
TOP = {"model", "model_kind", "device", "devices", "n_gpu_layers", "threads", "n_ctx"}
TOP |= {"prefill_chunk", "repeats", "cpu_backend", "device_memory", "decode", "contexts"}
TOP |= {"network_included", "exact_reuse", "flash_attn"}
ROW = {"context", "cold_prompt_tokens", "follow_prompt_tokens", "cached_tokens"}
ROW |= {"prefill_tokens_per_s", "ttft_cold_s", "ttft_cached_s", "checkpoint_bytes"}
ROW |= {"rewound_bytes", "ttft_restored_s"}
ROW |= {"save_gb_per_s", "restore_gb_per_s", "ship"}
SHIP = {"tokens", "blob_bytes", "state_bytes", "export_s", "copy_s", "import_s", "restore_s"}
SHIP |= {"end_to_end_s", "gb_per_s", "ttft_on_b_s", "continuation", "continuation_matches"}


def check_figures(result: dict) -> None:
    assert set(result) == TOP
    assert result["network_included"] is False
    decode = result["decode"]
    assert decode["streams"] == list(STREAMS)
    assert all(decode["tokens_per_s"][n] > 0 for n in ("1", "2"))
    assert decode["speedup"]["2"] == decode["tokens_per_s"]["2"] / decode["tokens_per_s"]["1"]
    for step in decode["step"].values():  # every decode step's call and sampling timed
        assert step["decode_call_ms"] > 0 and step["sample_ms"] > 0
    assert [row["context"] for row in result["contexts"]] == list(CONTEXTS)
    for row in result["contexts"]:
        assert set(row) == ROW
        assert row["cached_tokens"] == row["cold_prompt_tokens"]  # resident: all of it
        assert row["rewound_bytes"] == 0  # held as it is: no state copied at all
        assert row["prefill_tokens_per_s"] > 0 and row["checkpoint_bytes"] > 0
        assert row["save_gb_per_s"] > 0 and row["restore_gb_per_s"] > 0
        for ttft in (row["ttft_cold_s"], row["ttft_cached_s"], row["ttft_restored_s"]):
            assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
        ship = row["ship"]
        assert set(ship) == SHIP
        assert ship["continuation_matches"] and len(ship["continuation"]) == 16
        assert ship["blob_bytes"] > ship["state_bytes"] > 0 and ship["gb_per_s"] > 0
        # the stored conversation: the reply replayed, or the decode's state (all but its last)
        stored = row["follow_prompt_tokens"] + SHORT_REPLY.max_tokens - (not result["exact_reuse"])
        assert ship["tokens"] == stored
    assert "NOT the network transport" in format_report(result)


def child(path: str) -> None:
    """Runs in the child: the bench on every layer offloaded; prints its JSON."""
    settings = DeviceSettings(
        Path(path),
        contexts=CONTEXTS,
        repeats=REPEATS,
        threads=2,
        decode_tokens=DECODE_TOKENS,
        streams=STREAMS,
    )
    result = device_benchmark(settings)
    imported = [name for name in ("ray", "redis", "locust") if name in sys.modules]
    print(json.dumps({"result": result, "imported": imported}))


@pytest.mark.slow
def test_the_device_bench_offloads_every_layer_and_ships_between_two_engines(tiny_model) -> None:
    report = child_report(__file__, str(tiny_model("qwen35")))
    result = report["result"]
    skip_unless_device(result["device"])
    assert report["imported"] == []
    assert result["device"].startswith("Vulkan0: ") and result["devices"] == [result["device"]]
    assert [row["device"] for row in result["device_memory"]["loaded"]] == ["Vulkan0"]
    check_figures(result)


@pytest.mark.slow
def test_the_device_bench_runs_on_the_cpu_from_the_command_line(
    tiny_model, tmp_path, capsys
) -> None:
    contexts = ",".join(map(str, CONTEXTS))
    argv = ["bench", "device", "--model", str(tiny_model("qwen35")), "--n-gpu-layers", "0"]
    argv += ["--contexts", contexts, "--repeats", str(REPEATS), "--threads", "2", "--json"]
    argv += ["--streams", ",".join(map(str, STREAMS))]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "CPU" and result["devices"] == []
    assert json.loads((tmp_path / "device.json").read_text()) == result
    check_figures(result)


# `bench peer`'s workload, small: 6 requests of a few hundred tokens
SMALL_CHAT = PeerWorkload(
    chat_sessions=2,
    chat_turns=2,
    agent_sessions=1,
    agent_steps=2,
    system_tokens=120,
    document_tokens=60,
    turn_tokens=20,
    tool_tokens=30,
    reply_tokens=8,
)


@pytest.mark.slow
def test_the_device_bench_runs_llama_cpps_own_tools_beside_the_engine(tiny_model) -> None:
    settings = DeviceSettings(
        tiny_model("qwen35"),
        contexts=CONTEXTS[:1],
        repeats=1,
        n_gpu_layers=0,
        threads=2,
        decode_tokens=DECODE_TOKENS,
        streams=STREAMS,
        peer=True,
        chat=SMALL_CHAT,
    )
    result = device_benchmark(settings)
    peer = result["peer"]  # llama-batched-bench on the same model, threads and attention
    assert peer["tool"] == "llama-batched-bench" and peer["flash_attn"] == 0  # the engine's: off
    assert set(peer["decode_tokens_per_s"]) == {"1", "2"}
    assert all(rate > 0 for rate in peer["decode_tokens_per_s"].values())
    assert set(peer["prefill_tokens_per_s"]) == {str(result["contexts"][0]["cold_prompt_tokens"])}
    chat = result["peer_chat"]  # the multi-turn workload: the engine alone, then llama-server
    for side in ("baton", "llama-server"):
        assert chat[side]["requests"] == SMALL_CHAT.requests() and chat[side]["errors"] == 0
        assert chat[side]["completion_tokens"] == SMALL_CHAT.requests() * SMALL_CHAT.reply_tokens
        assert chat[side]["cached_tokens"] > 0  # each follow-up reuses its conversation
    assert {row["figure"] for row in chat["rows"]} >= {"ttft p50", "itl p95", "requests/s"}
    report = format_report(result)
    assert "beside llama.cpp's llama-batched-bench" in report
    assert "Baton's engine alone (no Ray, no gateway) beside llama-server" in report


def test_the_device_bench_refuses_contexts_it_cannot_run(tiny_model, capsys) -> None:
    with pytest.raises(ValueError, match="contexts must each be at least 160"):
        DeviceSettings(Path("model.gguf"), contexts=(100,))
    with pytest.raises(ValueError, match="n_ctx 512 is below the longest context 1024"):
        DeviceSettings(Path("model.gguf"), contexts=(1024,), n_ctx=512)
    with pytest.raises(ValueError, match="streams must each be at least 1"):
        DeviceSettings(Path("model.gguf"), streams=(0, 4))
    with pytest.raises(SystemExit):
        main(["bench", "device", "--contexts", "2k,8k"])
    assert "whole numbers separated by commas, got '2k,8k'" in capsys.readouterr().err


if __name__ == "__main__":
    child(sys.argv[1])
