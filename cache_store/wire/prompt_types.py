"""A prompt as it travels: token ids with the offsets where chat messages start, and the
chat message a template renders."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

SYSTEM_ROLES = frozenset({"system", "developer"})
AudioFormat = Literal["wav", "mp3"]  # OpenAI's input_audio formats


class ChatMessage(BaseModel):
    """One message as a chat template sees it (OpenAI's fields; tool call arguments as
    objects, which is what templates that print them with `tojson` expect)."""

    role: str = Field(min_length=1)
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def template_view(self) -> dict[str, Any]:
        """The message for a template: `content` always, other fields only when set
        (templates test `message.tool_calls is defined`)."""
        return {"content": self.content, **self.model_dump(exclude_none=True)}


class MediaInput(BaseModel):
    """An image or audio clip in a prompt: the file as the client sent it (a clip's with
    its `audio_format`) and the digest of its pixels or samples, which its placeholder ids
    in the prompt carry (`cache_store.media_tokens`)."""

    model_config = {"frozen": True}

    digest: bytes
    data: bytes
    audio_format: AudioFormat | None = None  # None: an image


class Prompt(BaseModel):
    """Token ids to prefill, and where each chat message starts (empty for raw prompts).
    `media`: the images and clips, one for each media span of `tokens`, in order."""

    model_config = {"frozen": True}

    tokens: tuple[int, ...]
    message_starts: tuple[int, ...] = ()
    message_roles: tuple[str, ...] = ()
    media: tuple[MediaInput, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def system_end(self) -> int | None:
        """Token offset where the leading system (or developer) messages end, if the prompt
        opens with any and goes on after them: the prefix sessions most often share."""
        for i, role in enumerate(self.message_roles):
            if role not in SYSTEM_ROLES:
                return self.message_starts[i] if i else None
        return None

    @property
    def last_user_start(self) -> int | None:
        """Token offset of the last user message, if any."""
        for start, role in zip(reversed(self.message_starts), reversed(self.message_roles)):
            if role == "user":
                return start
        return None
