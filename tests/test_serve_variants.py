"""Models with unusual metadata through the whole app: real Ray, two replicas, real HTTP.

A representative few of the generated variants (tests/test_model_variants.py runs them all
through the engine): the replicas start, a three-turn conversation of token-id prompts gives
the greedy text llama.cpp computes from scratch, later turns report cached tokens, and bad
input still gets a 4xx.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator

import httpx
import pytest
from fixtures_ray import wait_healthy
from ray import serve

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import APP_NAME, build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.tiny_model import ModelVariant, write_tiny_model

MAX_TOKENS = 6
VARIANTS = {
    # hybrid, llama.cpp's test vocabulary, no BOS, no EOS, no chat template
    "qwen35-test-vocab-no-bos-no-eos": ("qwen35", ModelVariant(vocab="test", bos=False, eos=False)),
    # attention, no chat template, a 512-token training context served with n_ctx 0
    "llama-no-template-ctx-512": ("llama", ModelVariant(chat_template=False, ctx_train=512)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_app(request, serve_port, tmp_path_factory) -> Iterator[tuple[str, BatonConfig]]:
    arch, variant = VARIANTS[request.param]
    path = write_tiny_model(
        arch, tmp_path_factory.mktemp("served") / f"{request.param}.gguf", variant=variant
    )
    config = BatonConfig(
        model=str(path),
        replicas=2,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=0, n_slots=1, n_threads=1),
        heartbeat_s=0.2,
        hmac_key=secrets.token_hex(16),
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{serve_port}"
    wait_healthy(url)
    yield url, config
    serve.delete(APP_NAME)


def _complete(url: str, config: BatonConfig, prompt: list[int]) -> dict:
    body = {
        "model": config.served_model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_conversation_is_exact_and_cached(variant_app) -> None:
    url, config = variant_app
    rng = random.Random(3)
    with Engine(
        config.model, EngineConfig(n_ctx=0, n_slots=1, prefix_cache=False), hmac_key=b"scratch"
    ) as scratch:
        n_vocab = scratch.model.n_vocab
        tokens = [rng.randrange(3, n_vocab) for _ in range(120)]
        for turn in range(3):
            body = _complete(url, config, tokens)
            fresh = scratch.generate(
                Prompt(tokens=tuple(tokens)), SamplingParams(max_tokens=MAX_TOKENS)
            )
            assert body["choices"][0]["text"] == fresh.text, f"turn {turn}"
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn:
                assert cached > 0, f"turn {turn}"
            tokens += fresh.tokens + [rng.randrange(3, n_vocab) for _ in range(20)]


def test_bad_input_still_gets_a_client_error(variant_app) -> None:
    url, config = variant_app
    too_big = httpx.post(
        f"{url}/v1/completions",
        json={"model": config.served_model_name, "prompt": [10**7], "max_tokens": 2},
        timeout=60,
    )
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "prompt"
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": config.served_model_name, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert chat.status_code == 400, chat.text
    assert "--chat-template" in chat.json()["error"]["message"]
    too_long = httpx.post(
        f"{url}/v1/completions",
        json={"model": config.served_model_name, "prompt": [5] * 9000, "max_tokens": 2},
        timeout=60,
    )
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
