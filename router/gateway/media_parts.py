"""Images in a chat's messages: counted and bounded, each replaced in its message's text by
a marker that `media_tokenizer` turns into the image's tokens once the chat template has
rendered the text around it, and read — its bytes from a data: URL or a listed host, its
pixels decoded — each in a prompt thread of its own, off the event loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_serve.replicas.engine.media_input import (
    DATA_URL_PREFIX,
    DecodedImage,
    MediaBounds,
    MediaError,
    data_url_bytes,
    decode_image,
)
from baton_serve.router.gateway.gateway_work import PromptThreads, all_or_none
from baton_serve.router.gateway.image_fetch import fetch_image
from baton_serve.router.gateway.openai_inputs import AudioPart, ImagePart, InputMessage, TextPart

MARKER_PREFIX = "<__baton_media_"


def media_marker(index: int) -> str:
    """The text standing for a request's `index`-th image in its rendered chat."""
    return f"{MARKER_PREFIX}{index}__>"


@dataclass(frozen=True)
class ImageSource:
    """Where an image part's bytes are, and the part's place in the request."""

    url: str
    param: str


@dataclass(frozen=True)
class MarkedChat:
    """A chat's messages with their content as text, a marker in place of each image, and
    the images' sources in marker order."""

    messages: list[InputMessage]
    sources: tuple[ImageSource, ...]


def has_media(messages: Sequence[InputMessage]) -> bool:
    return any(isinstance(m.content, list) for m in messages)


def mark_media(
    messages: Sequence[InputMessage], bounds: MediaBounds, takes_images: bool
) -> MarkedChat:
    """`messages` with a marker in place of each image; `MediaError` (its `param` naming the
    part) for more images than `max_images`, a part this server cannot take, or text that
    holds a marker."""
    count = sum(
        isinstance(part, ImagePart)
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
    )
    if count > bounds.max_images:
        raise MediaError(
            f"the messages hold {count} images; this server takes at most {bounds.max_images} "
            "a request (max_images)",
            "messages",
        )
    sources: list[ImageSource] = []
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
            elif isinstance(part, AudioPart):
                raise MediaError("this server takes no audio (input_audio parts)", param)
            else:
                if not takes_images:
                    raise MediaError(
                        "this model takes no images: it is served without a projector (--mmproj)",
                        param,
                    )
                texts.append((media_marker(len(sources)), True))
                sources.append(ImageSource(part.image_url.url, param))
        marked.append(message.model_copy(update={"content": _joined(texts)}))
    return MarkedChat(marked, tuple(sources))


def read_image(source: ImageSource, bounds: MediaBounds) -> DecodedImage:
    """The image at `source`, within `bounds`; `MediaError` naming its part."""
    if source.url.startswith(DATA_URL_PREFIX):
        data = data_url_bytes(source.url, bounds.max_image_bytes, source.param)
    else:
        data = fetch_image(source.url, bounds, source.param)
    return decode_image(data, bounds.max_image_pixels, source.param)


async def read_media(
    messages: Sequence[InputMessage],
    bounds: MediaBounds,
    takes_images: bool,
    threads: PromptThreads,
) -> tuple[list[InputMessage], tuple[DecodedImage, ...]]:
    """`mark_media`'s messages and every image read (`read_image`), each in a prompt thread
    of its own; the first `MediaError` stops the others."""
    marked = await threads.run(mark_media, messages, bounds, takes_images)
    reads = [threads.run(read_image, source, bounds) for source in marked.sources]
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
    return f"text may not hold {MARKER_PREFIX!r} in a request with images (it marks them)"
