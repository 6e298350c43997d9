"""A local engine demo: a short chat, streamed, with the prefix cache at work."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig

_QUESTIONS = (
    "What is the capital of France?",
    "Name one famous building there.",
    "Summarise our conversation in one sentence.",
)


def run_demo(model: Path, *, max_tokens: int = 64) -> None:
    """Chat three turns; print each reply as it streams, then its token accounting."""
    with Engine(
        str(model), EngineConfig(n_ctx=2048, n_slots=2), hmac_key=secrets.token_bytes(32)
    ) as engine:
        print(f"model: {model.name} ({engine.kind.value}), {engine.config.n_slots} slots")
        messages = [{"role": "system", "content": "You are a concise, helpful assistant."}]
        for question in _QUESTIONS:
            messages.append({"role": "user", "content": question})
            print(f"\nuser> {question}\nassistant> ", end="", flush=True)
            request = GenerationRequest(
                prompt=engine.chat_prompt(messages), sampling=SamplingParams(max_tokens=max_tokens)
            )
            handle = engine.submit(request)
            for event in handle:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            done = handle.result()
            u = done.usage
            print(
                f"\n  [prompt {u.prompt_tokens} tokens: {u.cached_tokens} reused, "
                f"{u.computed_tokens} computed; {u.completion_tokens} generated; "
                f"first token after {done.ttft_s:.3f} s]"
            )
            messages.append({"role": "assistant", "content": done.text})
