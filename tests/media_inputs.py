"""What the media tests send: images and audio clips as OpenAI content parts, and the prompt
the gateway builds from a chat holding them."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Callable

import numpy as np
from PIL import Image

from baton_serve.cache_store.wire.prompt_types import ChatMessage, Prompt
from baton_serve.replicas.engine.media_input import MediaBounds
from baton_serve.router.gateway.media_parts import mark_media, read_item
from baton_serve.router.gateway.openai_inputs import InputMessage
from baton_serve.router.gateway.prompt_builder import PromptBuilder


def image_url(seed: int, size: int = 80) -> str:
    """A PNG of random pixels as a data: URL."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def asking(seed: int, question: str = "What is in this picture?") -> dict:
    """A user message: a question and an image."""
    parts = [{"type": "text", "text": question}]
    return {
        "role": "user",
        "content": [*parts, {"type": "image_url", "image_url": image_url(seed)}],
    }


def wav_clip(seed: int, seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> bytes:
    """A WAV file of 16-bit noise."""
    rng = np.random.default_rng(seed)
    samples = (rng.standard_normal(int(seconds * rate) * channels) * 3000).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(samples.tobytes())
    return buffer.getvalue()


def audio_part(data: bytes, audio_format: str = "wav") -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format},
    }


def hearing(data: bytes, audio_format: str = "wav") -> dict:
    """A user message: a question and an audio clip."""
    question = {"type": "text", "text": "What is said here?"}
    return {"role": "user", "content": [question, audio_part(data, audio_format)]}


def hearing_noise(seed: int) -> dict:
    """A user message with a second of noise (`wav_clip(seed)`)."""
    return hearing(wav_clip(seed))


# A user message holding one item of each kind, by seed: what the tests that hold for both
# kinds open their chats with.
OPENINGS: dict[str, Callable[[int], dict]] = {"image": asking, "audio": hearing_noise}


def chat_prompt(
    builder: PromptBuilder, messages: list[dict], bounds: MediaBounds | None = None
) -> Prompt:
    """What the gateway builds: images and clips read and marked, the chat rendered and
    tokenised."""
    bounds, kinds = bounds or MediaBounds(), builder.media_kinds
    marked = mark_media([InputMessage(**m) for m in messages], bounds, kinds)
    chat = [ChatMessage(role=m.role, content=m.text) for m in marked.messages]
    media = [read_item(source, bounds, kinds) for source in marked.sources]
    return builder.from_messages(chat, media=media)
