"""What one request may ask of a gateway: the bounds `BatonConfig` inherits.

Each is checked before the work it bounds (bodies, lists, tokens, grammars, a request whose
replica died), and each refusal names its setting: docs/robustness.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from baton_serve.replicas.engine.media_input import AUDIO_SECONDS_CEILING, MediaBounds
from baton_serve.router.gateway.grammar_limits import (
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_CHOICES,
    SCHEMA_TIMEOUT_S,
)
from baton_serve.router.gateway.list_bounds import (
    MAX_DOCUMENTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGE_PARTS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)
from baton_serve.router.gateway.transport_defaults import BODY_READ_TIMEOUT_S


class RequestBounds(BaseModel):
    """The gateway's bounds on one request (fields of `BatonConfig`, set like the others)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: int = Field(
        default=4 << 20, ge=1, description="largest request body accepted (larger: 413)"
    )
    body_read_timeout_s: float = Field(
        default=BODY_READ_TIMEOUT_S,
        gt=0,
        allow_inf_nan=False,
        description="seconds a request's whole body may take to arrive; later: 408 naming "
        "the setting, and the connection and its gateway slot are freed. The default takes a "
        "max_body_bytes body (4 MiB) at 140 kB/s, a poor mobile uplink: a client slower than "
        "that holds a slot rather than sending a request",
    )
    max_messages: int = Field(
        default=2048,
        ge=1,
        description="most messages in one chat request; more get a 400 naming the setting, "
        "before any message is validated",
    )
    max_prompts: int = Field(
        default=256,
        ge=1,
        description="most prompts in one completion request; more get a 400 naming the setting",
    )
    max_prompt_bytes: int = Field(
        default=4 << 20,
        ge=1,
        description="largest prompt text, a chat as its template renders it; larger gets a "
        "413, before it is tokenised",
    )
    max_tokens_cap: int | None = Field(
        default=None,
        ge=1,
        description="most tokens one choice may generate: a max_tokens (or "
        "max_completion_tokens) above it gets a 400 naming the setting, and a request without "
        "one generates at most this many; unset: the context left after the prompt, which "
        "bounds every request anyway (more than it is refused, code context_length_exceeded)",
    )
    max_request_tokens: int | None = Field(
        default=None,
        ge=1,
        description="most tokens one request may hold in replica slots: n × the sum over its "
        "prompts of (prompt tokens + max_tokens, or the context left when unset); more gets a "
        "400 naming the setting, before any replica sees it. Unset: 16 (the most choices, n) "
        "× the context window, so any request one replica could serve (n full-context "
        "choices) passes, while 256 prompts × n 16 × long replies, which could hold every "
        "slot of a cluster up to the 600 s deadline, do not",
    )
    max_tools: int = Field(
        default=MAX_TOOLS,
        ge=1,
        description="most tools in one chat request (OpenAI's own limit); more get a 400 "
        "naming the setting, counted before any tool's schema is validated",
    )
    max_documents: int = Field(
        default=MAX_DOCUMENTS,
        ge=1,
        description="most documents (vLLM's RAG template variable) in one chat request, as "
        "many as max_messages by default: each is rendered like a message; more get a 400 "
        "naming the setting, counted before any is validated",
    )
    max_logit_bias: int = Field(
        default=MAX_LOGIT_BIAS,
        ge=1,
        description="most logit_bias entries in one request (OpenAI takes 300, llama-server "
        "and vLLM any number): each is built into llama.cpp's sampler for every choice on "
        "the replica's engine thread; more get a 400 naming the setting, and one token id "
        'given twice ("1" and "01") is refused',
    )
    max_stop_token_ids: int = Field(
        default=MAX_STOP_TOKEN_IDS,
        ge=1,
        description="most stop_token_ids in one request (vLLM has no limit; a model's end "
        "tokens are a handful): each generated token is looked up among them; more get a 400 "
        "naming the setting",
    )
    max_message_parts: int = Field(
        default=MAX_MESSAGE_PARTS,
        ge=1,
        description="most content parts (content sent as a list) and tool calls in all the "
        "messages of one chat request, 4 per message at the default max_messages: each is "
        "validated on the gateway's event loop (a 4 MiB body of 70,000 tool calls took 2 s); "
        "more get a 400 naming the setting, counted as they are met",
    )
    max_images: int = Field(
        default=MediaBounds.max_images,
        ge=0,
        description="most images in one chat request (a model served with mmproj); more get "
        "a 400 naming the setting, counted before any image is read",
    )
    max_image_bytes: int = Field(
        default=MediaBounds.max_image_bytes,
        ge=1,
        description="largest image file (a data: URL's decoded bytes), checked before its "
        "base64 is decoded; larger gets a 400 naming the part. The whole body is bounded by "
        "max_body_bytes too: serve images larger than about 3 MiB with a larger one",
    )
    max_image_pixels: int = Field(
        default=MediaBounds.max_image_pixels,
        ge=1,
        description="most pixels of one image (8K by default), read from its header before "
        "its pixels are decoded; more gets a 400 naming the part",
    )
    image_url_hosts: list[str] = Field(
        default=[],
        description="hosts (NAME or NAME:PORT) whose http(s) image URLs the gateway fetches, "
        "within max_image_bytes and image_fetch_timeout_s, following no redirects; empty: "
        "none (a URL gets a 400 naming the setting). Fetching on a client's behalf reaches "
        "what the server can reach: list only hosts that serve images to anyone",
    )
    image_fetch_timeout_s: float = Field(
        default=MediaBounds.fetch_timeout_s,
        gt=0,
        allow_inf_nan=False,
        description="seconds an image fetch may wait to connect, and for each read",
    )
    max_audio_clips: int = Field(
        default=MediaBounds.max_audio_clips,
        ge=0,
        description="most input_audio parts in one chat request (a model served with an "
        "mmproj that reads audio); more get a 400 naming the setting, counted before any "
        "clip is read",
    )
    max_audio_bytes: int = Field(
        default=MediaBounds.max_audio_bytes,
        ge=1,
        description="largest audio file (an input_audio part's decoded bytes), checked before "
        "its base64 is decoded; larger gets a 400 naming the part",
    )
    max_audio_seconds: float = Field(
        default=MediaBounds.max_audio_seconds,
        gt=0,
        le=AUDIO_SECONDS_CEILING,
        allow_inf_nan=False,
        description="longest clip, read from its header (WAV) or counted frames (MP3) before "
        "its samples are decoded; longer gets a 400 naming the part. A Whisper-style encoder "
        "reads a clip in windows of 30 s, each the same number of tokens (Voxtral 375, "
        "Qwen2-Audio 750)",
    )
    max_grammar_chars: int = Field(
        default=MAX_GRAMMAR_CHARS,
        ge=1,
        description="longest grammar a reply may follow, in characters: a raw grammar as sent, "
        "or the one built from guided_choice, a JSON schema (response_format, guided_json, "
        "json_schema) or a forced tool call, refused as soon as building passes it; also the "
        "largest strict tool schema (as JSON) calls are checked against. llama.cpp applies the "
        "grammar at every token on the engine thread; more gets a 400 naming the field",
    )
    max_grammar_choices: int = Field(
        default=MAX_GRAMMAR_CHOICES,
        ge=1,
        description="most alternatives one place of a grammar offers: guided_choice's "
        "strings, a JSON schema's enum values, anyOf/oneOf branches, a pattern's | branches "
        "or an object's optional properties, counted before anything is built, and a raw "
        "grammar's (through its rules). llama.cpp's grammar filter follows each at every "
        "token while co-batched streams wait: over a 49k-token vocabulary 100 choices took "
        "25 ms a token, 1,000 took 0.3 s, 5,000 1.7 s (150,000 got no answer in 120 s); more "
        "gets a 400 naming the field",
    )
    schema_timeout_s: float = Field(
        default=SCHEMA_TIMEOUT_S,
        gt=0,
        allow_inf_nan=False,
        description="longest a request's grammar may take to build, off the event loop "
        "(more: a 400 naming the field), and a reply's strict tool calls to be checked "
        "against their schemas (a call not checked in time is dropped as one that does not "
        "match). The other bounds keep every build far shorter (the slowest allowed, "
        "measured: ~0.1 s); this answers the request if one is not",
    )
    poison_quarantine_s: float = Field(
        default=600.0,
        ge=0,
        allow_inf_nan=False,
        description="a request whose replica died while running it is answered 500 and never "
        "sent to another replica; for this many seconds an identical request (same prompt "
        "tokens and sampling) gets a 400 from that gateway before reaching any replica. Longer "
        "than clients' automatic retries (SDKs resend a 5xx within seconds) and a person's: a "
        "body that crashes replicas costs one per gateway per quarantine; 0: repeats are sent",
    )
    poison_quarantine_entries: int = Field(
        default=4096,
        ge=1,
        description="most requests a gateway keeps in quarantine (the oldest go first): a "
        "replica that dies loses at most 4 × n_slots + 4 requests, so the default holds about "
        "200 deaths, in about 1 MiB",
    )
