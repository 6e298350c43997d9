"""The engine's figures say where time and bytes go: state bytes copied between host memory
and the context, per request and engine-wide, and TTFT that counts the restore.

Real llama.cpp on a generated hybrid model, whose follow-ups restore full sequence states.
"""

from __future__ import annotations

import pytest

from baton_serve.loadtests.engine_bench import chat_figures, format_report, run_chat
from baton_serve.replicas.wire.prompt_types import Prompt
from baton_serve.replicas.wire.sampling_params import SamplingParams

FIRST_TOKEN_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)  # no rewind, no replay after


def _tokens(n_vocab: int, start: int, n: int) -> tuple[int, ...]:
    return tuple((i * 7919) % (n_vocab - 3) + 3 for i in range(start, start + n))


@pytest.fixture
def hybrid(tiny_model, make_engine):
    return make_engine(
        tiny_model("qwen35"), prefill_chunk=48, checkpoint_interval=64, block_tokens=32
    )


def test_state_bytes_counted_per_request(hybrid) -> None:
    stats, n_vocab = hybrid.stats, hybrid.model.n_vocab
    first = Prompt(tokens=_tokens(n_vocab, 0, 200))
    cold = hybrid.generate(first, SamplingParams(max_tokens=6, ignore_eos=True))
    assert cold.usage.cached_tokens == 0 and cold.timings.restored_bytes == 0
    assert 0 < cold.timings.saved_bytes <= stats.saved_bytes  # its prompt's checkpoints
    assert hybrid.wait_idle(30)  # the reply replayed: the slot holds more than `first`
    saved, restored = stats.saved_bytes, stats.restored_bytes

    follow_up = Prompt(tokens=first.tokens + _tokens(n_vocab, 500, 40))
    done = hybrid.generate(follow_up, FIRST_TOKEN_ONLY)
    assert hybrid.wait_idle(30)

    assert done.usage.cached_tokens > 0
    assert done.timings.restored_bytes == stats.restored_bytes - restored > 0
    assert done.timings.saved_bytes == stats.saved_bytes - saved > 0


def test_restore_time_counts_in_ttft(hybrid) -> None:
    n_vocab = hybrid.model.n_vocab
    first = Prompt(tokens=_tokens(n_vocab, 0, 200))
    hybrid.generate(first, SamplingParams(max_tokens=6, ignore_eos=True))
    assert hybrid.wait_idle(30)

    done = hybrid.generate(Prompt(tokens=first.tokens + (7, 8, 9, 10)), FIRST_TOKEN_ONLY)

    timings = done.timings
    assert done.usage.cached_tokens > 0 and timings.restored_bytes > 0
    assert done.ttft_s is not None and 0 < timings.restore_s <= done.ttft_s <= done.total_s
    assert done.ttft_s == pytest.approx(timings.restore_s + timings.prefill_s)


def test_exported_bytes_counted(hybrid) -> None:
    hybrid.generate(Prompt(tokens=_tokens(hybrid.model.n_vocab, 0, 120)), FIRST_TOKEN_ONLY)
    checkpoint = max(hybrid.checkpoints(), key=lambda c: c.n_tokens)
    blob = hybrid.export_checkpoint(checkpoint.prefix_hash)
    assert blob is not None
    head, state = blob
    assert hybrid.stats.exported_bytes == len(head) + state.nbytes > checkpoint.n_tokens


def test_bench_engine_reports_state_copies(tiny_model) -> None:
    rows = run_chat(
        tiny_model("qwen35"),
        turns=2,
        system_tokens=150,
        turn_tokens=30,
        reply_tokens=8,
        n_ctx=1024,
        threads=2,
    )
    cold, follow_up = rows
    assert cold.restored_bytes == 0 < cold.turn_restored_bytes  # the rewind after the reply
    assert 0 < cold.saved_bytes < cold.turn_saved_bytes  # and the replay's checkpoint
    assert 0 < follow_up.restored_bytes <= follow_up.turn_restored_bytes
    assert 0 < follow_up.restore_s <= follow_up.ttft_s

    rate = {"prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}
    speed = {"cpu_repack": False, **rate} | {f"{key}_range": [1.0, 1.0] for key in rate}
    header = {"model": "m", "threads": 2, "cpu_backend": "CPU", "system_info": "", "speed": speed}
    report = format_report(header | chat_figures(rows))
    assert f"{follow_up.restore_s:.3f}" in report
    assert f"restored {(cold.restored_bytes + follow_up.restored_bytes) / 1e6:.1f} MB" in report
