"""Images (and, where the rule is the same, audio clips) in the conversation, on real
llama.cpp with generated models and projectors: the gateway's prompt (its template, the
item's tokens and identity) and the engine's cache, which serves a follow-up turn without
running the encoder again, bit-exact, and never serves one item's state for another's. Both
position schemes: qwen35's projector is the Qwen-VL line's (M-RoPE, an image takes fewer
positions than tokens), llama's takes one position a token, as a clip does everywhere."""

from __future__ import annotations

import numpy as np
import pytest
from media_inputs import OPENINGS, asking, chat_prompt

from baton_serve.cache_store.media_tokens import media_spans
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import EngineError, GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.media_projector import MediaProjector, ProjectorError
from baton_serve.replicas.engine.prompt import PromptError

GREEDY = SamplingParams(max_tokens=8)
# (arch, item): both position schemes for images; a clip on the hybrid
FOLLOW_UPS = [("qwen35", "image"), ("llama", "image"), ("qwen35", "audio")]


@pytest.mark.parametrize(("builder", "item"), FOLLOW_UPS, indirect=["builder"])
def test_a_follow_up_turn_is_served_from_cache_without_the_encoder(
    builder, item, tiny_model, tiny_projector, make_engine
) -> None:
    arch = builder._model.path.stem
    model, mmproj = tiny_model(arch), tiny_projector(arch)
    engine = make_engine(model, mmproj, prefill_chunk=16, block_tokens=16)
    scratch = make_engine(model, mmproj, prefix_cache=False)
    messages = [{"role": "system", "content": "You describe what you get."}, OPENINGS[item](1)]
    first = chat_prompt(builder, messages)
    (span,) = media_spans(first.tokens)
    reply = engine.generate(first, GREEDY)
    assert engine.stats.images_encoded == 1

    # the reply replayed (a turn sent during the replay may read the item again: an estimate)
    assert engine.wait_idle(30)
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "More?"}]
    second = chat_prompt(builder, messages)
    assert second.tokens[: span[1]] == first.tokens[: span[1]] and len(second.media) == 1
    resumed = engine.generate(second, GREEDY, return_logits=True)
    fresh = scratch.generate(second, GREEDY, return_logits=True)

    assert engine.stats.images_encoded == 1  # the item's state came from the cache
    assert engine.stats.images_read == 1  # and the follow-up did not even read the item
    assert resumed.usage.cached_tokens > span[1]
    assert resumed.tokens == fresh.tokens
    assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0


@pytest.mark.parametrize("item", sorted(OPENINGS))
@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_a_different_item_with_the_same_text_is_never_served_from_cache(
    builder, item, tiny_model, tiny_projector, make_engine
) -> None:
    engine = make_engine(tiny_model("qwen35"), tiny_projector("qwen35"))
    opening = OPENINGS[item]
    red, blue = chat_prompt(builder, [opening(1)]), chat_prompt(builder, [opening(2)])
    (span,) = media_spans(red.tokens)
    assert red.tokens[: span[0]] == blue.tokens[: span[0]] and red.tokens != blue.tokens
    engine.generate(red, GREEDY)
    again = engine.generate(blue, GREEDY)
    assert again.usage.cached_tokens <= span[0]
    assert engine.stats.images_encoded == 2


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_a_state_holding_an_image_serves_another_engine(
    builder, tiny_model, tiny_projector, make_engine
) -> None:
    """What a pull between replicas does: the checkpoint after the image, shipped as a
    blob, serves the follow-up on an engine that never saw the image."""
    model, mmproj = tiny_model("qwen35"), tiny_projector("qwen35")
    first, second = make_engine(model, mmproj), make_engine(model, mmproj)
    scratch = make_engine(model, mmproj, prefix_cache=False)
    prompt = chat_prompt(builder, [asking(3)])
    first.generate(prompt, GREEDY)
    assert first.wait_idle(30)  # the conversation's state is stored once the engine is idle
    best = max(first.checkpoints(), key=lambda c: c.n_tokens)
    (span,) = media_spans(prompt.tokens)
    assert best.n_tokens > span[1]
    second.import_checkpoint(first.export_checkpoint(best.prefix_hash))

    more = tuple(second.model.tokenize(" And what else?"))
    follow_up = prompt.model_copy(update={"tokens": tuple(best.tokens.tolist()) + more})
    on_second = second.generate(follow_up, GREEDY, return_logits=True)
    assert second.stats.images_encoded == 0
    assert on_second.usage.cached_tokens == best.n_tokens
    from_scratch = scratch.generate(follow_up, GREEDY, return_logits=True)
    assert on_second.tokens == from_scratch.tokens
    assert float(np.abs(on_second.logits - from_scratch.logits).max()) == 0.0


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_a_state_holding_an_image_serves_the_next_turn_after_a_restart(
    builder, tiny_model, tiny_projector, make_engine, tmp_path
) -> None:
    """The disk tier (what a restarted or replaced replica starts from): the conversation's
    state, written when its engine closed, serves the next turn on an engine started on the
    same directory, without the encoder, bit-exact."""
    model, mmproj = tiny_model("qwen35"), tiny_projector("qwen35")
    first = make_engine(model, mmproj, checkpoint_dir=str(tmp_path))
    prompt = chat_prompt(builder, [asking(6)])
    first.generate(prompt, GREEDY)
    assert first.wait_idle(30)  # the conversation's state is stored once the engine is idle
    best = max(first.checkpoints(), key=lambda c: c.n_tokens)
    first.close()
    assert list(tmp_path.rglob("*.ckpt"))

    more = tuple(builder.tokenize(" And then?", add_special=False, parse_special=False))
    follow_up = prompt.model_copy(update={"tokens": tuple(best.tokens.tolist()) + more})
    restarted = make_engine(model, mmproj, checkpoint_dir=str(tmp_path))
    resumed = restarted.generate(follow_up, GREEDY, return_logits=True)
    scratch = make_engine(model, mmproj, prefix_cache=False)
    fresh = scratch.generate(follow_up, GREEDY, return_logits=True)
    assert resumed.usage.cached_tokens == best.n_tokens > media_spans(prompt.tokens)[0][1]
    assert restarted.stats.images_encoded == 0
    assert resumed.tokens == fresh.tokens
    assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_ids_that_are_not_their_image_are_refused(
    builder, tiny_model, tiny_projector, make_engine
) -> None:
    engine = make_engine(tiny_model("qwen35"), tiny_projector("qwen35"))
    red, blue = chat_prompt(builder, [asking(1)]), chat_prompt(builder, [asking(2)])
    with pytest.raises(PromptError, match="not its item's"):
        engine.generate(red.model_copy(update={"media": blue.media}), GREEDY)
    with pytest.raises(PromptError, match="1 media spans; it carries 0"):
        engine.generate(red.model_copy(update={"media": ()}), GREEDY)
    text_only = make_engine(tiny_model("qwen35"))
    with pytest.raises(PromptError, match="takes no images"):
        text_only.generate(red, GREEDY)


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_an_image_that_fails_to_encode_ends_only_its_request(
    builder, tiny_model, tiny_projector, make_engine, monkeypatch
) -> None:
    """A fake fault (llama.cpp refusing an image cannot be caused with a valid file): the
    request fails with an engine error, a text request beside it and the next one are served."""
    engine = make_engine(tiny_model("qwen35"), tiny_projector("qwen35"))

    def refuse(*_args: object) -> None:
        raise ProjectorError("llama.cpp could not encode the image (code 1) [injected]")

    monkeypatch.setattr(MediaProjector, "encode", refuse)
    text = Prompt(tokens=tuple(engine.model.tokenize("Hello there, how are you?")))
    failing = engine.submit(
        GenerationRequest(prompt=chat_prompt(builder, [asking(4)]), sampling=GREEDY)
    )
    beside = engine.submit(GenerationRequest(prompt=text, sampling=GREEDY))
    with pytest.raises(EngineError):
        failing.result()
    assert len(beside.result().tokens) == GREEDY.max_tokens
    assert len(engine.generate(text, GREEDY).tokens) == GREEDY.max_tokens
