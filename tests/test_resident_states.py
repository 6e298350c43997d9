"""Resident states: a hybrid or recurrent slot rewound to a partial state (no attention KV)
holds exactly what restoring the full state would give, and serves prompts bit-exactly.

Real llama.cpp on generated models of each family whose memory cannot be cut back.
"""

from __future__ import annotations

import numpy as np
import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.llama_context import BatchEntry, ContextParams, LlamaContext
from baton_serve.replicas.engine.llama_model import LlamaModel

PARTIAL_KINDS = ["qwen35", "granitehybrid", "lfm2", "mamba2"]
GREEDY = SamplingParams(max_tokens=6)


def _tokens(n_vocab: int, n: int) -> list[int]:
    return [(i * 7919) % (n_vocab - 3) + 3 for i in range(n)]


@pytest.mark.parametrize("arch", PARTIAL_KINDS)
def test_partial_restore_then_trim_gives_the_full_checkpoint_bytes(arch, tiny_model) -> None:
    """Load the partial state after 60 tokens into a sequence that went on to 96 (prompt
    pieces, then one token at a time), cut the cells after 60: the sequence's full state is
    byte for byte the one saved at 60."""
    model = LlamaModel(tiny_model(arch), n_gpu_layers=0)
    params = ContextParams(n_ctx_per_seq=256, n_seqs=2, n_batch=64, n_threads=2)
    with LlamaContext(model, params) as context:
        tokens = _tokens(model.n_vocab, 96)

        def feed(start: int, end: int) -> None:
            context.decode([BatchEntry(0, tokens[p], p, False) for p in range(start, end)])

        feed(0, 40)
        feed(40, 60)
        full_at_60, partial_at_60 = bytes(context.save_state(0)), context.save_partial(0)
        feed(60, 90)
        for position in range(90, 96):  # decode-time state, built one token at a time
            feed(position, position + 1)

        context.rewind(0, 60, partial_at_60)

        assert bytes(context.save_state(0)) == full_at_60
        assert len(partial_at_60) < len(full_at_60) or arch == "mamba2"  # mamba: no KV at all
    model.close()


@pytest.mark.parametrize("arch", PARTIAL_KINDS)
def test_an_edited_turn_rewinds_its_slot_and_is_bit_exact(arch, tiny_model, make_engine) -> None:
    """The last user message edited: the slot is rewound to its anchor at that message's
    start (no full state copied) and continues exactly as a from-scratch prefill."""
    path = tiny_model(arch)
    engine = make_engine(path, prefill_chunk=48, block_tokens=32)
    scratch = make_engine(path, prefix_cache=False)
    system = {"role": "system", "content": "Answer briefly and precisely. " * 10}
    first = engine.chat_prompt([system, {"role": "user", "content": "What is item 7?"}])
    engine.generate(first, GREEDY)
    assert engine.wait_idle(30)

    edited = engine.chat_prompt([system, {"role": "user", "content": "And what is item 9?"}])
    resumed = engine.generate(edited, GREEDY, return_logits=True)
    fresh = scratch.generate(edited, GREEDY, return_logits=True)

    assert resumed.usage.cached_tokens == edited.last_user_start
    assert resumed.timings.restored_bytes == 0 < resumed.timings.rewound_bytes
    assert resumed.tokens == fresh.tokens
    assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0


def test_a_slot_given_away_stores_its_finished_conversation_first(tiny_model, make_engine):
    """A finished conversation is stored once the engine is idle; one whose slot is taken
    before then (the next request already waits for it) is stored as the slot is given
    away, where that is worth it, so the conversation's next turn still finds it."""
    engine = make_engine(tiny_model("qwen35"), n_slots=1, prefill_chunk=48, block_tokens=32)
    n_vocab = engine.model.n_vocab
    conversation = Prompt(tokens=tuple(_tokens(n_vocab, 150)))
    other = Prompt(tokens=tuple(reversed(_tokens(n_vocab, 80))))
    first = engine.submit(GenerationRequest(prompt=conversation, sampling=GREEDY))
    engine.submit(GenerationRequest(prompt=other, sampling=GREEDY)).result(timeout=60)
    reply = first.result(timeout=60)
    assert engine.wait_idle(30)

    assert engine.stats.written_back == 1  # `other`'s, not the conversation's
    history = conversation.tokens + tuple(reply.tokens)
    follow_up = Prompt(tokens=history + (5, 6, 7, 8))
    done = engine.generate(follow_up, GREEDY)
    assert done.usage.cached_tokens == len(history)
    assert done.timings.restored_bytes > 0  # from the store: the slot holds the other prompt
