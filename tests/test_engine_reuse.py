"""Prefix reuse is exact: resumed conversations equal from-scratch computation, bit for bit.

Real llama.cpp on generated models of every architecture family.
"""

from __future__ import annotations

import numpy as np
import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.llama_model import ModelKind
from baton_serve.replicas.models.tiny_model import ARCHITECTURES

KINDS = {
    "llama": ModelKind.ATTENTION,
    "qwen35": ModelKind.HYBRID,
    "lfm2": ModelKind.HYBRID,
    "granitehybrid": ModelKind.HYBRID,
    "mamba2": ModelKind.RECURRENT,
}
GREEDY = SamplingParams(max_tokens=10)
SYSTEM = "You are a careful assistant who answers in short sentences. " * 12


def _conversation(engine: Engine, scratch: Engine, turns: int = 3) -> list[tuple]:
    """Run `turns` chat turns on `engine`; recompute each turn's prompt on `scratch`."""
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: what about item {turn * 13}?"})
        prompt = engine.chat_prompt(messages)
        resumed = engine.generate(prompt, GREEDY, return_logits=True)
        fresh = scratch.generate(prompt, GREEDY, return_logits=True)
        results.append((prompt, resumed, fresh))
        messages.append({"role": "assistant", "content": resumed.text})
    return results


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_resumed_conversation_is_bit_exact(arch, tiny_model, make_engine) -> None:
    path = tiny_model(arch)
    engine = make_engine(path, prefill_chunk=48, checkpoint_interval=64, block_tokens=32)
    scratch = make_engine(path, prefix_cache=False)
    assert engine.kind is KINDS[arch]

    results = _conversation(engine, scratch)

    for turn, (prompt, resumed, fresh) in enumerate(results):
        assert resumed.tokens == fresh.tokens, f"turn {turn}"
        assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0, f"turn {turn}"
        assert fresh.usage.cached_tokens == 0
        if turn:  # later turns reuse most of the conversation and compute only the rest
            assert resumed.usage.cached_tokens >= len(results[turn - 1][0]) - MIN_PIECE
            assert resumed.usage.computed_tokens == len(prompt) - resumed.usage.cached_tokens
    if engine.kind.needs_checkpoints:
        assert engine.stats.checkpoints_saved > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_exported_to_a_second_engine_is_bit_exact(arch, tiny_model, make_engine) -> None:
    """What another replica does: import the blob, restore it, continue — same result."""
    path = tiny_model(arch)
    first = make_engine(path)
    second = make_engine(path)
    scratch = make_engine(path, prefix_cache=False)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    first.generate(first.chat_prompt(messages), GREEDY)
    if first.kind is ModelKind.ATTENTION:  # its KV is saved when the slot is reused
        first.generate(first.text_prompt("An unrelated prompt for the other slot."), GREEDY)
        first.generate(first.text_prompt("Another unrelated prompt evicts the first."), GREEDY)

    best = max(first.checkpoints(), key=lambda c: c.n_tokens)
    blob = first.export_checkpoint(best.prefix_hash)
    assert blob is not None
    assert second.import_checkpoint(blob).n_tokens == best.n_tokens

    follow_up = Prompt(
        tokens=tuple(best.tokens.tolist()) + tuple(second.model.tokenize(" Go on, please."))
    )
    on_second = second.generate(follow_up, GREEDY, return_logits=True)
    from_scratch = scratch.generate(follow_up, GREEDY, return_logits=True)

    assert second.stats.checkpoints_restored == 1
    assert on_second.usage.cached_tokens == best.n_tokens
    assert on_second.usage.computed_tokens == len(follow_up) - best.n_tokens
    assert on_second.tokens == from_scratch.tokens
    assert float(np.abs(on_second.logits - from_scratch.logits).max()) == 0.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_with_exact_reuse_off_a_reply_is_computed_once(arch, tiny_model, make_engine) -> None:
    """`exact_reuse` off (llama-server's way): no replay; the state the decode built is
    stored, the next turn continues from it computing only its own tokens, and a second
    engine that imports it continues bit for bit as the first does."""
    path = tiny_model(arch)
    settings = {"exact_reuse": False, "prefill_chunk": 48, "block_tokens": 32}
    engine, peer = make_engine(path, **settings), make_engine(path, **settings)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    prompt = engine.chat_prompt(messages)
    reply = engine.generate(prompt, GREEDY)
    assert engine.wait_idle(30)

    kept = max(engine.checkpoints(), key=lambda c: c.n_tokens)
    history = prompt.tokens + tuple(reply.tokens)
    assert engine.stats.replayed_tokens == 0
    # Every token fed to the decode: all but a last one sampled and never fed.
    assert kept.n_tokens >= len(history) - 1
    assert tuple(kept.tokens.tolist()) == history[: kept.n_tokens]

    follow_up = Prompt(tokens=history + tuple(engine.model.tokenize(" Go on, please.")))
    blob = engine.export_checkpoint(kept.prefix_hash)
    assert blob is not None and peer.import_checkpoint(blob).n_tokens == kept.n_tokens
    here = engine.generate(follow_up, GREEDY, return_logits=True)
    there = peer.generate(follow_up, GREEDY, return_logits=True)

    for result in (here, there):
        assert result.usage.cached_tokens == kept.n_tokens
        assert result.usage.computed_tokens == len(follow_up) - kept.n_tokens
    assert engine.stats.prompt_tokens_computed == len(prompt) + here.usage.computed_tokens
    assert here.tokens == there.tokens
    assert float(np.abs(here.logits - there.logits).max()) == 0.0


def test_attention_state_serves_prompts_sharing_only_its_beginning(tiny_model, make_engine) -> None:
    """An evicted conversation's KV serves another conversation with the same header (an
    agent's tool list): restored, cut back to the shared prefix, bit-exact."""
    path = tiny_model("llama")
    engine = make_engine(path, n_slots=1)
    scratch = make_engine(path, prefix_cache=False)
    header = [{"role": "system", "content": "Tools: search, fetch, summarise. " * 20}]
    engine.generate(engine.chat_prompt(header + [{"role": "user", "content": "Task one."}]), GREEDY)
    engine.generate(engine.text_prompt("Something unrelated evicts the only slot."), GREEDY)

    other = engine.chat_prompt(header + [{"role": "user", "content": "A different task."}])
    shared_header = other.message_starts[1]
    resumed = engine.generate(other, GREEDY, return_logits=True)
    fresh = scratch.generate(other, GREEDY, return_logits=True)

    assert resumed.usage.cached_tokens >= shared_header
    assert engine.stats.checkpoints_restored == 1
    assert resumed.tokens == fresh.tokens
    assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0


def test_an_evicted_slot_is_saved_when_that_beats_recomputing_its_tail(
    tiny_model, make_engine
) -> None:
    """A slot holding a stored state plus a few tokens (a pulled prefix and the request's
    own) is saved again when it is given away only if saving its state takes less time than
    recomputing those tokens would, at the engine's measured speeds; when the engine stops,
    always."""
    path = tiny_model("llama")
    engine = make_engine(path, n_slots=1)
    one_token = SamplingParams(max_tokens=1)

    def long_states() -> list[int]:
        return sorted(c.n_tokens for c in engine.checkpoints() if c.n_tokens > 64)

    def evict(text: str) -> None:
        engine.generate(engine.text_prompt(text), one_token)

    engine.generate(engine.text_prompt("A long document about rivers. " * 30), one_token)
    evict("Something unrelated.")
    [stored] = long_states()
    state = max(engine.checkpoints(), key=lambda c: c.n_tokens)
    base = tuple(state.tokens.tolist())

    # This tiny model's state saves far faster than its tokens compute: the tail is kept.
    follow_up = Prompt(
        tokens=base
        + tuple(engine.model.tokenize(" And then, tell me more about the rivers of the far north?"))
    )
    assert engine.generate(follow_up, one_token).usage.cached_tokens == stored
    evict("Something else again.")
    assert long_states() == [stored, len(follow_up)]

    # Where saving is slow (here the engine's save counters say 1 MB/s, a stand-in for a
    # big state on a fast GPU), a few tokens more are recomputed instead of copied.
    engine.stats.save_seconds, engine.stats.saved_bytes = 1.0, 1_000_000
    again = Prompt(tokens=base + tuple(engine.model.tokenize(" Next, please.")))
    assert engine.generate(again, one_token).usage.cached_tokens == stored
    evict("Some third unrelated prompt.")
    assert long_states() == [stored, len(follow_up)]

    # A stopping engine (a replica leaving, its hottest states handed to peers) keeps what
    # its idle slots hold at any cost: no request waits for the copy.
    engine.generate(again, one_token)
    engine.stop()
    assert long_states() == [stored, len(again), len(follow_up)]
