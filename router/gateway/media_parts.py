"""Images and audio clips in a chat's messages: counted and bounded, each replaced in its
message's text by a marker that `media_tokenizer` turns into the item's tokens once the
chat template has rendered the text around it, and read — an image's bytes from a data:
URL or a listed host, its pixels decoded; a clip's from its base64, its samples decoded —
each in a prompt thread of its own, off the event loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_serve.replicas.engine.media_input import (
    DATA_URL_PREFIX,
    DecodedMedia,
    MediaBounds,
    MediaError,
    base64_bytes,
    data_url_bytes,
    decode_audio,
    decode_image,
)
from baton_serve.router.gateway.gateway_work import PromptThreads, all_or_none
from baton_serve.router.gateway.image_fetch import fetch_image
from baton_serve.router.gateway.openai_inputs import AudioPart, ImagePart, InputMessage, TextPart

MARKER_PREFIX = "<__baton_media_"


def media_marker(index: int) -> str:
    """The text standing for a request's `index`-th image or clip in its rendered chat."""
    return f"{MARKER_PREFIX}{index}__>"


@dataclass(frozen=True)
class MediaKinds:
    """What the served projector reads: images, and audio clips at `audio_rate` Hz (None:
    no audio)."""

    images: bool = False
    audio_rate: int | None = None

    def modalities(self) -> list[str]:
        """What `/v1/models` lists: text, and what the projector reads."""
        read = [("image", self.images), ("audio", self.audio_rate is not None)]
        return ["text", *(name for name, taken in read if taken)]


@dataclass(frozen=True)
class MediaSource:
    """An image or audio part, and its place in the request."""

    part: ImagePart | AudioPart
    param: str


@dataclass(frozen=True)
class MarkedChat:
    """A chat's messages with their content as text, a marker in place of each image and
    clip, and their parts in marker order."""

    messages: list[InputMessage]
    sources: tuple[MediaSource, ...]


def has_media(messages: Sequence[InputMessage]) -> bool:
    return any(isinstance(m.content, list) for m in messages)


def _count(messages: Sequence[InputMessage], kind: type) -> int:
    return sum(
        isinstance(part, kind)
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
    )


def mark_media(
    messages: Sequence[InputMessage], bounds: MediaBounds, kinds: MediaKinds
) -> MarkedChat:
    """`messages` with a marker in place of each image and clip; `MediaError` (its `param`
    naming the part) for more than `max_images` or `max_audio_clips`, a part this server
    cannot take, or text that holds a marker."""
    for kind, most, name, setting in (
        (ImagePart, bounds.max_images, "images", "max_images"),
        (AudioPart, bounds.max_audio_clips, "audio clips", "max_audio_clips"),
    ):
        if (count := _count(messages, kind)) > most:
            raise MediaError(
                f"the messages hold {count} {name}; this server takes at most {most} a "
                f"request ({setting})",
                "messages",
            )
    sources: list[MediaSource] = []
    marked = []
    for k, message in enumerate(messages):
        if isinstance(message.content, str) and MARKER_PREFIX in message.content:
            raise MediaError(_marker_refused(), f"messages[{k}].content")
        if not isinstance(message.content, list):
            marked.append(message)
            continue
        texts: list[tuple[str, bool]] = []  # (text, whether it is a marker)
        for j, part in enumerate(message.content):
            param = f"messages[{k}].content[{j}]"
            if isinstance(part, TextPart):
                if MARKER_PREFIX in part.text:
                    raise MediaError(_marker_refused(), param)
                texts.append((part.text, False))
            else:
                _check_taken(part, kinds, param)
                texts.append((media_marker(len(sources)), True))
                sources.append(MediaSource(part, param))
        marked.append(message.model_copy(update={"content": _joined(texts)}))
    return MarkedChat(marked, tuple(sources))


def _check_taken(part: ImagePart | AudioPart, kinds: MediaKinds, param: str) -> None:
    """`MediaError` where the served model cannot read `part`."""
    if isinstance(part, ImagePart) and not kinds.images:
        raise MediaError(
            "this model takes no images: it is served without a projector (--mmproj) "
            "or its projector reads none",
            param,
        )
    if isinstance(part, AudioPart) and kinds.audio_rate is None:
        raise MediaError(
            "this model takes no audio (input_audio parts): it is served without a projector "
            "(--mmproj) or its projector reads none",
            param,
        )


def read_item(source: MediaSource, bounds: MediaBounds, kinds: MediaKinds) -> DecodedMedia:
    """The image or clip of `source`, within `bounds`; `MediaError` naming its part."""
    part, param = source.part, source.param
    if isinstance(part, AudioPart):
        assert kinds.audio_rate is not None  # mark_media refused the part otherwise
        audio = part.input_audio
        data = base64_bytes(audio.data, bounds.max_audio_bytes, param)
        return decode_audio(
            data,
            audio.format,
            sample_rate=kinds.audio_rate,
            max_seconds=bounds.max_audio_seconds,
            param=param,
        )
    url = part.image_url.url
    if url.startswith(DATA_URL_PREFIX):
        data = data_url_bytes(url, bounds.max_image_bytes, param)
    else:
        data = fetch_image(url, bounds, param)
    return decode_image(data, bounds.max_image_pixels, param)


async def read_media(
    messages: Sequence[InputMessage],
    bounds: MediaBounds,
    kinds: MediaKinds,
    threads: PromptThreads,
) -> tuple[list[InputMessage], tuple[DecodedMedia, ...]]:
    """`mark_media`'s messages and every image and clip read (`read_item`), each in a
    prompt thread of its own; the first `MediaError` stops the others."""
    marked = await threads.run(mark_media, messages, bounds, kinds)
    reads = [threads.run(read_item, source, bounds, kinds) for source in marked.sources]
    return marked.messages, tuple(await all_or_none(reads))


def _joined(parts: list[tuple[str, bool]]) -> str:
    """The parts' text: text parts joined with newlines, none before or after a marker (as
    llama.cpp's chat code joins them, so both count a message's tokens alike)."""
    text = ""
    after_marker = False
    for part, is_marker in parts:
        if not is_marker and text and not after_marker:
            text += "\n"
        text += part
        after_marker = is_marker
    return text


def _marker_refused() -> str:
    return f"text may not hold {MARKER_PREFIX!r} in a request with images or audio (it marks them)"
