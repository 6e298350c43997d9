"""The engine's figures say where time and bytes go: state bytes copied between host memory
and the context, per request and engine-wide, and TTFT that counts the restore.

Real llama.cpp on a generated hybrid model: a follow-up whose prefix is resident rewinds its
slot to a partial state (no attention KV); one served from the store restores a full state.
"""

from __future__ import annotations

import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.decode_beside_prompts import decode_beside_prompts, format_beside
from baton_serve.loadtests.engine_bench import chat_figures, format_report, run_chat

FIRST_TOKEN_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)  # no rewind, no replay after
SHORT_REPLY = SamplingParams(max_tokens=6, ignore_eos=True)


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
    cold = hybrid.generate(first, SHORT_REPLY)
    assert cold.usage.cached_tokens == 0 and cold.timings.restored_bytes == 0
    assert 0 < cold.timings.saved_bytes <= stats.saved_bytes  # interval checkpoints, for peers
    assert 0 < cold.timings.anchor_bytes <= stats.anchor_bytes  # and partial states in its slot
    assert hybrid.wait_idle(30)  # replayed, and the conversation stored once idle
    assert stats.written_back == 1
    saved, anchored, rewound = stats.saved_bytes, stats.anchor_bytes, stats.rewound_bytes

    follow_up = Prompt(tokens=first.tokens + _tokens(n_vocab, 500, 40))  # not the reply
    done = hybrid.generate(follow_up, FIRST_TOKEN_ONLY)
    assert hybrid.wait_idle(30)

    assert done.usage.cached_tokens == len(first) - 2  # the anchor before its last piece
    assert done.timings.rewound_bytes == stats.rewound_bytes - rewound > 0
    assert done.timings.anchor_bytes == stats.anchor_bytes - anchored > 0
    assert done.timings.saved_bytes == stats.saved_bytes - saved == 0  # no full state on its path


def test_resident_prefix_copies_no_attention_bytes(hybrid) -> None:
    """The slot still holds the prefix's attention cells: only the recurrent state is
    loaded, far less than the full state a restore would copy."""
    n_vocab = hybrid.model.n_vocab
    first = Prompt(tokens=_tokens(n_vocab, 0, 200))
    hybrid.generate(first, SHORT_REPLY)
    assert hybrid.wait_idle(30)

    done = hybrid.generate(Prompt(tokens=first.tokens[:150] + (7, 8, 9, 10)), FIRST_TOKEN_ONLY)

    cached, timings = done.usage.cached_tokens, done.timings
    assert cached == 128 and timings.restored_bytes == 0  # the anchor at 2 x interval
    fixed, _ = hybrid.state_size
    assert 0 < timings.rewound_bytes <= fixed  # a full state: fixed + cached x per_token


def test_restore_time_counts_in_ttft(hybrid, make_engine) -> None:
    """A state pulled from a peer is restored into a slot: the restore is part of TTFT."""
    n_vocab = hybrid.model.n_vocab
    first = Prompt(tokens=_tokens(n_vocab, 0, 200))
    hybrid.generate(first, SHORT_REPLY)
    assert hybrid.wait_idle(30)
    stored = max(hybrid.checkpoints(), key=lambda c: c.n_tokens)
    peer = make_engine(hybrid.model.path, prefill_chunk=48, block_tokens=32)
    peer.import_checkpoint(hybrid.export_checkpoint(stored.prefix_hash))

    tokens = tuple(stored.tokens.tolist()) + (7, 8, 9, 10)
    done = peer.generate(Prompt(tokens=tokens), FIRST_TOKEN_ONLY)

    timings = done.timings
    assert done.usage.cached_tokens == stored.n_tokens and timings.restored_bytes > 0
    assert done.ttft_s is not None and 0 < timings.restore_s <= done.ttft_s <= done.total_s
    assert done.ttft_s == pytest.approx(timings.restore_s + timings.prefill_s)


def test_exported_bytes_counted(hybrid) -> None:
    hybrid.generate(Prompt(tokens=_tokens(hybrid.model.n_vocab, 0, 120)), SHORT_REPLY)
    assert hybrid.wait_idle(30)
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
    assert cold.restored_bytes == cold.turn_restored_bytes == 0  # rewinds copy no full state
    assert 0 < cold.partial_bytes < cold.turn_partial_bytes  # the rewind after the reply
    assert 0 < cold.saved_bytes < cold.turn_saved_bytes  # and the conversation, once idle
    assert follow_up.restored_bytes == 0 and follow_up.cached_tokens > 0
    assert 0 < follow_up.restore_s <= follow_up.ttft_s

    rate = {"prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}
    speed = {"cpu_repack": False, **rate} | {f"{key}_range": [1.0, 1.0] for key in rate}
    header = {"model": "m", "threads": 2, "cpu_backend": "CPU", "system_info": "", "speed": speed}
    report = format_report(header | chat_figures(rows))
    assert f"{follow_up.restore_s:.3f}" in report
    assert f"restored {(cold.restored_bytes + follow_up.restored_bytes) / 1e6:.1f} MB" in report
    partial = (cold.partial_bytes + follow_up.partial_bytes) / 1e6
    assert f"(partial {partial:.1f} MB)" in report


def test_streams_decoding_beside_prompts_are_timed_with_the_cache_on_and_off(tiny_model):
    figures = decode_beside_prompts(
        tiny_model("qwen35"), system_tokens=300, threads=2, hmac_key=b"bench"
    )

    on, off = figures["cache_on"], figures["cache_off"]
    for row in (on, off):
        assert row["gaps"] > 0 and 0 < row["p50_s"] <= row["p95_s"] <= row["p99_s"]
    assert on["anchor_bytes"] > 0  # the prompts' anchors, taken between decode steps
    assert off["saved_bytes"] == off["anchor_bytes"] == 0
    assert "p99 with the cache on / off" in format_beside(figures)[-1]
