"""Images in a chat's messages: counted and bounded, read (in a prompt thread, off the event
loop), and each replaced in its message's text by a marker that `media_tokenizer` turns
into the image's tokens once the chat template has rendered the text around it."""

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
from baton_serve.router.gateway.image_fetch import fetch_image
from baton_serve.router.gateway.openai_inputs import AudioPart, ImagePart, InputMessage, TextPart

MARKER_PREFIX = "<__baton_media_"


def media_marker(index: int) -> str:
    """The text standing for a request's `index`-th image in its rendered chat."""
    return f"{MARKER_PREFIX}{index}__>"


@dataclass(frozen=True)
class ChatMedia:
    """A chat's messages with their content as text (a marker in place of each image), and
    the images, in marker order."""

    messages: list[InputMessage]
    images: tuple[DecodedImage, ...]


def has_media(messages: Sequence[InputMessage]) -> bool:
    return any(isinstance(m.content, list) for m in messages)


def resolve_media(
    messages: Sequence[InputMessage], bounds: MediaBounds, takes_images: bool
) -> ChatMedia:
    """Read every image of `messages`; `MediaError` (its `param` naming the part) for a part
    this server cannot take, an image over a bound, or one that does not decode."""
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
    images: list[DecodedImage] = []
    resolved = []
    for k, message in enumerate(messages):
        if isinstance(message.content, str) and MARKER_PREFIX in message.content:
            raise MediaError(_marker_refused(), f"messages[{k}].content")
        if not isinstance(message.content, list):
            resolved.append(message)
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
                data = _image_bytes(part.image_url.url, bounds, param)
                images.append(decode_image(data, bounds.max_image_pixels, param))
                texts.append((media_marker(len(images) - 1), True))
        resolved.append(message.model_copy(update={"content": _joined(texts)}))
    return ChatMedia(resolved, tuple(images))


def _image_bytes(url: str, bounds: MediaBounds, param: str) -> bytes:
    if url.startswith(DATA_URL_PREFIX):
        return data_url_bytes(url, bounds.max_image_bytes, param)
    return fetch_image(url, bounds, param)


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
