"""A prompt's images and audio clips on the engine: its placeholder ids checked against the
items it carries, each item not in the prefix the engine likely holds read and prepared
where the request is submitted (off the engine loop), and encoded and fed on the loop only
when its piece is computed — never for an item whose state a cached prefix already holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from baton_serve.cache_store.media_tokens import (
    MEDIA_TOKEN_BASE,
    media_spans,
    media_tokens,
    positions_after,
)
from baton_serve.cache_store.wire.prompt_types import MediaInput, Prompt
from baton_serve.replicas.engine.llama_context import LlamaContext
from baton_serve.replicas.engine.media_input import (
    AUDIO_SECONDS_CEILING,
    DecodedMedia,
    MediaError,
    decode_audio,
    decode_image,
)
from baton_serve.replicas.engine.media_projector import MediaProjector, PreparedMedia
from baton_serve.replicas.engine.prompt import PromptError
from baton_serve.replicas.engine.stats import EngineStats

# The gateway has bounded each image's pixels and each clip's length; a replica reads what
# it is sent, no more (a clip: no longer than any setting allows).
MAX_PIXELS = 1 << 26


def check_prompt_ids(prompt: Prompt, n_vocab: int, projector: MediaProjector | None) -> None:
    """`PromptError` unless each id of `prompt` is in the vocabulary or one of the
    placeholders of the image or clip it carries there (and the model has a projector)."""
    tokens = prompt.tokens
    if all(0 <= t < n_vocab for t in tokens) and not prompt.media:
        return
    if any(t < 0 or n_vocab <= t < MEDIA_TOKEN_BASE for t in tokens):
        raise PromptError(f"token ids must be in [0, {n_vocab})")
    if projector is None:
        raise PromptError(
            "this model takes no images or audio: it is served without a projector (--mmproj)"
        )
    spans = media_spans(tokens)
    if len(spans) != len(prompt.media):
        raise PromptError(
            f"the prompt's ids hold {len(spans)} media spans; it carries {len(prompt.media)} "
            "images and clips"
        )
    for (start, end), item in zip(spans, prompt.media, strict=True):
        ids = tokens[start:end]
        n_pos = positions_after(ids)
        if n_pos == 0 or ids != media_tokens(projector.identity(item.digest), end - start, n_pos):
            raise PromptError(f"the ids at [{start}, {end}) are not its item's")


@dataclass
class PromptMedia:
    """A request's images and clips, by the start of their span in its prompt: those its
    cached prefix likely holds are not read at all, the others are prepared at submission;
    one the estimate missed is prepared when its piece comes (`feed`)."""

    prompt: Prompt
    projector: MediaProjector
    n_batch: int
    spans: tuple[tuple[int, int], ...]
    prepared: dict[int, PreparedMedia] = field(default_factory=dict)
    _embeddings: dict[int, np.ndarray] = field(default_factory=dict)

    def prepare(self, from_token: int, stats: EngineStats) -> None:
        """Read and prepare each item at or after `from_token`."""
        for index, (start, end) in enumerate(self.spans):
            if start >= from_token and start not in self.prepared:
                item = self.prompt.media[index]
                self.prepared[start] = _prepared(
                    self.prompt, self.projector, self.n_batch, start, end, item
                )
                stats.images_read += 1

    def close(self) -> None:
        for image in self.prepared.values():
            image.close()
        self.prepared.clear()
        self._embeddings.clear()

    def feed(
        self,
        context: LlamaContext,
        start: int,
        *,
        seq_id: int,
        position: int,
        stats: EngineStats,
    ) -> None:
        """Encode the item at `start` (once a request: a replay may feed it again) and
        decode its embeddings into `seq_id` from `position` on."""
        if start not in self.prepared:
            self.prepare(start, stats)
        image = self.prepared[start]
        embeddings = self._embeddings.get(start)
        if embeddings is None:
            started = time.perf_counter()
            embeddings = self.projector.encode(image, context.model.n_embd_input)
            self._embeddings[start] = embeddings
            stats.images_encoded += 1
            stats.encode_seconds += time.perf_counter() - started
        self.projector.feed(
            context.pointer,
            image,
            embeddings,
            seq_id=seq_id,
            position=position,
            n_batch=context.params.n_batch,
        )


def prepare_media(
    prompt: Prompt,
    projector: MediaProjector | None,
    n_batch: int,
    likely_cached: int,
    stats: EngineStats,
) -> PromptMedia | None:
    """`prompt`'s images and clips (checked by `check_prompt_ids`), those after the
    `likely_cached` tokens read and prepared now; `PromptError` where an item is not the one
    its ids name, or cannot be fed in calls of `n_batch` tokens. None for a prompt without
    any."""
    if not prompt.media or projector is None:
        return None
    images = PromptMedia(prompt, projector, n_batch, tuple(media_spans(prompt.tokens)))
    try:
        images.prepare(likely_cached, stats)
    except BaseException:
        images.close()
        raise
    return images


def _prepared(
    prompt: Prompt,
    projector: MediaProjector,
    n_batch: int,
    start: int,
    end: int,
    item: MediaInput,
) -> PreparedMedia:
    try:
        decoded = _decoded(item, projector)
    except MediaError as exc:
        raise PromptError(f"the item at [{start}, {end}): {exc}") from None
    if decoded.digest != item.digest:
        raise PromptError(f"the item at [{start}, {end}) is not the one its ids name")
    prepared = projector.prepare(decoded)
    layout, n_pos = prepared.layout, positions_after(prompt.tokens[start:end])
    if (layout.n_tokens, layout.n_pos) != (end - start, n_pos):
        prepared.close()
        raise PromptError(
            f"the item at [{start}, {end}) takes {layout.n_tokens} tokens and "
            f"{layout.n_pos} positions here, not {end - start} and {n_pos} "
            "(the gateway's projector is not this replica's)"
        )
    if prepared.whole and layout.n_tokens > n_batch:
        prepared.close()
        raise PromptError(
            f"the item at [{start}, {end}) takes {layout.n_tokens} tokens, fed in one "
            f"call; this engine's calls take at most {n_batch} (engine.n_batch)"
        )
    return prepared


def _decoded(item: MediaInput, projector: MediaProjector) -> DecodedMedia:
    """`item` read again from the bytes the gateway read it from."""
    if item.audio_format is None:
        return decode_image(item.data, MAX_PIXELS)
    if projector.audio_rate is None:
        raise MediaError("this model's projector reads no audio")
    return decode_audio(
        item.data,
        item.audio_format,
        sample_rate=projector.audio_rate,
        max_seconds=AUDIO_SECONDS_CEILING,
    )
