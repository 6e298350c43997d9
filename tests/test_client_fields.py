"""The fields mainstream clients send beyond OpenAI's own (vLLM's and llama-server's), over
real HTTP to a real replica of a generated model: each served field does what vLLM defines,
each refused one is refused by name, and the field table agrees with the models."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_harness import serving

from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.sampling import TokenSampler
from baton_serve.router.gateway import api_fields, refused_fields
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "baton-tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello! Who are you?"}]
DOCS = Path(__file__).parent.parent / "docs" / "api-fields.md"
# ChatML with reasoning, showing the template variables vLLM fills from request fields.
VARIABLES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }} "
    "thinking={{ enable_thinking }}\n{% endif %}"
    "{% for d in documents or [] %}doc={{ d.text }}\n{% endfor %}{% endif %}"
)


@pytest.fixture(scope="module")
def model_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen35")


@pytest.fixture(scope="module")
def client(model_path: Path) -> Iterator[httpx.Client]:
    settings = GatewaySettings(MODEL, str(model_path), n_ctx=1024, max_tokens_cap=256)
    with serving(settings, EngineConfig(n_ctx=1024, n_slots=2, n_threads=2)) as served:
        with httpx.Client(base_url=served.url, timeout=60) as client:
            yield client


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 6, "ignore_eos": True, **fields}


def _text(prompt: object, **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **fields}


def _post(client: httpx.Client, path: str, body: dict[str, object]) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _chunks(client: httpx.Client, path: str, body: dict[str, object]) -> list[dict]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---- continuous usage (vLLM's benchmark clients, guidellm) -----------------------------------

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_is_on_every_chunk(client: httpx.Client, path: str) -> None:
    """As vLLM sends it: every chunk has the usage so far of its choice, then a last chunk
    has the whole usage; the second identical request finds the prompt cached. The body is
    guidellm's (which also sends `"stop": null`)."""
    body = _chat() if path == CHAT else _text("Once upon a time", ignore_eos=True)
    body |= {"stream": True, "stream_options": CONTINUOUS, "max_tokens": 8, "stop": None}
    for attempt in range(2):
        *chunks, last = _chunks(client, path, body)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
        final = last["usage"]
        assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in chunks)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 8
        assert all(
            c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
            for c, n in zip(chunks, counts)
        )
        cached = {c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks}
        assert cached == {final["prompt_tokens_details"]["cached_tokens"]}
        if attempt:
            assert cached.pop() > 0
    if path == CHAT:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and counts[0] == 0


def test_continuous_usage_needs_include_usage(client: httpx.Client) -> None:
    """vLLM: continuous_usage_stats alone adds nothing."""
    options = {"include_usage": False, "continuous_usage_stats": True}
    chunks = _chunks(client, CHAT, _chat(stream=True, stream_options=options))
    assert all("usage" not in c for c in chunks)


# ---- fields that change the reply --------------------------------------------------------------


def _end_token(model_path: Path) -> int:
    with LlamaModel(model_path, vocab_only=True) as model:
        return model.end_tokens[0]


def test_min_tokens_holds_back_the_end(client: httpx.Client, model_path: Path) -> None:
    """An end-of-generation token forced by logit_bias ends the reply at once; min_tokens
    holds it back for that many tokens. ignore_eos generates through it."""
    forced = {"logit_bias": {str(_end_token(model_path)): 100}, "max_tokens": 8}
    assert _post(client, COMPLETIONS, _text("Hi", **forced))["usage"]["completion_tokens"] == 0
    held = _post(client, COMPLETIONS, _text("Hi", min_tokens=5, **forced))
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    through = _post(client, COMPLETIONS, _text("Hi", ignore_eos=True, **forced))
    assert through["usage"]["completion_tokens"] == 8


def test_min_tokens_holds_back_stop_token_ids(client: httpx.Client) -> None:
    first = _post(client, COMPLETIONS, _text("Hi", max_tokens=1, ignore_eos=True, logprobs=0))
    token = first["choices"][0]["logprobs"]["tokens"][0]
    ids = client.post("/tokenize", json={"content": token}).json()["tokens"]
    body = _text("Hi", stop_token_ids=ids[:1], ignore_eos=True, max_tokens=6)
    assert _post(client, COMPLETIONS, body)["usage"]["completion_tokens"] == 0
    held = _post(client, COMPLETIONS, {**body, "min_tokens": 3})
    assert held["usage"]["completion_tokens"] >= 3


def test_min_tokens_over_max_tokens_is_refused(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json=_text("Hi", min_tokens=10, max_tokens=5))
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens"


def test_include_stop_str_in_output(client: httpx.Client) -> None:
    whole = _post(client, COMPLETIONS, _text("Once", max_tokens=12, ignore_eos=True))
    text = whole["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    start = text.index(stop)
    body = _text("Once", max_tokens=12, ignore_eos=True, stop=[stop])
    assert _post(client, COMPLETIONS, body)["choices"][0]["text"] == text[:start]
    kept = {**body, "include_stop_str_in_output": True}
    assert _post(client, COMPLETIONS, kept)["choices"][0]["text"] == text[: start + 2]
    streamed = _chunks(client, COMPLETIONS, {**kept, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed) == text[: start + 2]


def test_echo_puts_the_prompt_first(client: httpx.Client) -> None:
    plain = _post(client, COMPLETIONS, _text("Once upon", ignore_eos=True))["choices"][0]["text"]
    echoed = _post(client, COMPLETIONS, _text("Once upon", ignore_eos=True, echo=True))
    assert echoed["choices"][0]["text"] == "Once upon" + plain
    streamed = _chunks(
        client, COMPLETIONS, _text("Once upon", ignore_eos=True, echo=True, stream=True)
    )
    assert streamed[0]["choices"][0]["text"] == "Once upon"
    assert "".join(c["choices"][0]["text"] for c in streamed) == "Once upon" + plain
    ids = client.post("/tokenize", json={"content": "Once upon"}).json()["tokens"]
    by_ids = _post(client, COMPLETIONS, _text(ids, ignore_eos=True, echo=True))
    assert by_ids["choices"][0]["text"] == "Once upon" + plain


def test_echo_with_logprobs_is_refused(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json=_text("Hi", echo=True, logprobs=1))
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_skip_special_tokens_leaves_control_tokens_out(client: httpx.Client) -> None:
    (start,) = client.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"]
    forced = _text("Hi", logit_bias={str(start): 100}, ignore_eos=True, max_tokens=3)
    assert _post(client, COMPLETIONS, forced)["choices"][0]["text"] == "<|im_start|>" * 3
    skipped = _post(client, COMPLETIONS, {**forced, "skip_special_tokens": True})
    assert skipped["choices"][0]["text"] == "" and skipped["usage"]["completion_tokens"] == 3


def test_guided_choice_and_guided_json(client: httpx.Client) -> None:
    choices = ["yes", 'a "quoted" answer']
    for seed in range(3):
        body = _text("Answer:", guided_choice=choices, temperature=1.0, seed=seed, max_tokens=20)
        assert _post(client, COMPLETIONS, body)["choices"][0]["text"] in choices
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = _post(client, CHAT, _chat(guided_json=schema, ignore_eos=False, max_tokens=40))
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"])["n"], int)


def test_generation_prompt_and_continued_message(client: httpx.Client) -> None:
    """add_generation_prompt false ends the prompt after the last message; with
    continue_final_message the reply continues it (its end-of-turn marker is cut off)."""
    said = [*HELLO, {"role": "assistant", "content": "I am"}]
    usage = {
        ending: _post(client, CHAT, _chat(messages=said, **fields))["usage"]["prompt_tokens"]
        for ending, fields in {
            "opened": {},
            "closed": {"add_generation_prompt": False},
            "continued": {"add_generation_prompt": False, "continue_final_message": True},
        }.items()
    }
    assert usage["continued"] < usage["closed"] < usage["opened"]
    both = client.post(CHAT, json=_chat(continue_final_message=True))
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


@pytest.fixture(scope="module")
def templated(model_path: Path) -> Iterator[httpx.Client]:
    """A gateway whose chat template is `VARIABLES_TEMPLATE`."""
    settings = GatewaySettings(MODEL, str(model_path), n_ctx=1024, chat_template=VARIABLES_TEMPLATE)
    with serving(settings, EngineConfig(n_ctx=1024, n_slots=1, n_threads=2)) as served:
        with httpx.Client(base_url=served.url, timeout=60) as client:
            yield client


def test_template_variables(templated: httpx.Client) -> None:
    """reasoning_effort and documents reach the chat template (and enable_thinking with
    them, unless chat_template_kwargs sets it), as vLLM passes them."""

    def added(**fields: object) -> int:
        body = _chat(max_tokens=1, **fields)
        with_fields = _post(templated, CHAT, body)["usage"]["prompt_tokens"]
        return with_fields - _post(templated, CHAT, _chat(max_tokens=1))["usage"]["prompt_tokens"]

    def tokens(text: str) -> int:
        return len(templated.post("/tokenize", json={"content": text}).json()["tokens"])

    assert added(reasoning_effort="none") == tokens("effort=none thinking=False\n")
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    assert added(reasoning_effort="none", **kwargs) == tokens("effort=none thinking=True\n")
    assert added(documents=[{"text": "Paris"}]) == tokens("doc=Paris\n")


def test_include_reasoning_false_drops_it(templated: httpx.Client) -> None:
    """A reply that continues an opened <think> is reasoning: left out on request."""
    said = [*HELLO, {"role": "assistant", "content": "<think>"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True, "messages": said}
    shown = _post(templated, CHAT, _chat(**fields))["choices"][0]["message"]
    hidden = _post(templated, CHAT, _chat(include_reasoning=False, **fields))["choices"][0]
    assert shown["reasoning_content"] and "reasoning_content" not in hidden["message"]


# ---- llama-server's samplers: on synthetic rows, and accepted over HTTP ------------------------


def _draws(logits: list[float], **params: object) -> set[int]:
    """The tokens 40 seeded samplers pick from `logits` at temperature 1."""
    row = np.array(logits, dtype=np.float32)
    picked = set()
    for seed in range(40):
        sampler = TokenSampler(SamplingParams(temperature=1.0, seed=seed, **params), len(row))
        picked.add(sampler(row))
        sampler.close()
    return picked


def test_typical_p_keeps_the_typical_tokens() -> None:
    """p = (0.4, 0.3, 0.3): the entropy is nearer the 0.3 tokens' surprisal, so a tiny
    typical_p never leaves the most likely token."""
    logits = list(np.log([0.4, 0.3, 0.3]))
    assert _draws(logits) == {0, 1, 2}
    assert 0 not in _draws(logits, typical_p=0.01)


def test_xtc_excludes_the_top_choices() -> None:
    """Every token above the threshold but the least likely of them is cut (probability 1)."""
    logits = list(np.log([0.5, 0.3, 0.2]))
    assert _draws(logits, xtc_probability=1.0, xtc_threshold=0.1) == {2}


def test_top_n_sigma_keeps_logits_near_the_top() -> None:
    logits = [2.0, 1.9, 0, 0, 0, 0, 0, 0]
    assert len(_draws(logits)) > 2
    assert _draws(logits, top_n_sigma=0.5) == {0, 1}


def test_mirostat_with_a_tiny_target_picks_the_top_token() -> None:
    logits = [1.0, 1.2, 1.1, 1.0, 0.9]
    assert len(_draws(logits)) > 1
    for version in (1, 2):
        assert _draws(logits, mirostat=version, mirostat_tau=0.01) == {1}


def test_llama_server_samplers_are_accepted(client: httpx.Client) -> None:
    fields = {"typical_p": 0.9, "top_n_sigma": 1.5, "xtc_probability": 0.5, "mirostat": 0}
    assert _post(client, COMPLETIONS, _text("Hi", temperature=1.0, **fields))["choices"]
    miro = _post(client, CHAT, _chat(temperature=1.0, mirostat=2, mirostat_tau=3.0))
    assert miro["usage"]["completion_tokens"] == 6


# ---- refused fields, and the table -------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "use_beam_search", True),
        (CHAT, "verbosity", "low"),
        (CHAT, "dry_multiplier", 0.8),
        (CHAT, "guided_regex", "a+"),
        (CHAT, "truncate_prompt_tokens", 10),
        (COMPLETIONS, "suffix", "x"),
        (COMPLETIONS, "prompt_logprobs", 1),
    ],
)
def test_refused_fields_are_named_with_the_reason(
    client: httpx.Client, path: str, field: str, value: object
) -> None:
    body = _chat(**{field: value}) if path == CHAT else _text("Hi", **{field: value})
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    reasons = refused_fields.CHAT if path == CHAT else refused_fields.COMPLETIONS
    assert error["code"] == "unsupported_parameter" and error["param"] == field
    assert reasons[field] in error["message"]


def test_the_field_table_matches_the_models(client: httpx.Client) -> None:
    """docs/api-fields.md is what the models say (regenerate it with
    `python -m baton_serve.router.gateway.api_fields > docs/api-fields.md`), every served field is
    described, and /openapi.json lists the refused ones."""
    assert DOCS.read_text() == api_fields.fields_table()
    assert all(text for _, _, _, text in api_fields.field_rows())
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["x-refused-fields"] == refused_fields.CHAT
    assert schemas["CompletionRequest"]["x-refused-fields"] == refused_fields.COMPLETIONS
    for model, refused in api_fields.ENDPOINTS.values():
        assert not model.model_fields.keys() & refused.keys()


def test_llama_server_json_schema_and_grammar(client: httpx.Client) -> None:
    """llama-server's `json_schema` (as guided_json) and `grammar` (raw GBNF) shape the
    reply; a grammar llama.cpp cannot parse, or two guides at once, get a 400."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = _post(client, CHAT, _chat(json_schema=schema, ignore_eos=False, max_tokens=40))
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"])["n"], int)
    for seed in range(3):
        body = _text("Answer:", grammar='root ::= "yes" | "no"', temperature=1.0, seed=seed)
        assert _post(client, COMPLETIONS, body)["choices"][0]["text"] in ("yes", "no")
    broken = client.post(COMPLETIONS, json=_text("Answer:", grammar="root ::= (("))
    assert broken.status_code == 400 and "grammar" in broken.json()["error"]["message"]
    both = client.post(CHAT, json=_chat(json_schema=schema, grammar='root ::= "x"'))
    assert both.status_code == 400 and both.json()["error"]["param"] == "grammar"
    assert "not json_schema and this" in both.json()["error"]["message"]
