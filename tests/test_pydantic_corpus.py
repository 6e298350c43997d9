"""Schemas real code writes: every model in tests/pydantic_corpus.py is served, and a
generated model sampling at temperature 1 under the schema's grammar (llama.cpp's grammar
sampler) writes JSON that the pydantic model itself accepts."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grammar_sampler import GrammarSampler
from pydantic_corpus import MODELS

from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.sampling import grammar_problem
from baton_serve.router.gateway.structured_output import schema_grammar

SEEDS = 2


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[str], Path]) -> Iterator[LlamaModel]:
    with LlamaModel(tiny_model("llama")) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def sampler(model: LlamaModel) -> Iterator[GrammarSampler]:
    made = GrammarSampler(model)
    yield made
    made.close()


def test_the_corpus_covers_what_pydantic_writes() -> None:
    """Bounds of each kind, formats, unions, discriminated unions, sets, tuples, maps."""
    text = " ".join(str(m.model_json_schema()) for m in MODELS.values())
    for keyword in (
        "'minimum'", "'maximum'", "'exclusiveMinimum'", "'exclusiveMaximum'", "'multipleOf'",
        "'date'", "'date-time'", "'time'", "'duration'", "'uuid'", "'uuid4'", "'email'",
        "'uri'", "'ipv4'", "'ipv6'", "'uniqueItems'", "'discriminator'", "'prefixItems'",
        "'additionalProperties'", "'anyOf'", "'$ref'", "'enum'", "'const'", "'pattern'",
    ):  # fmt: skip
        assert keyword in text, keyword
    assert len(MODELS) >= 20


@pytest.mark.parametrize("name", MODELS)
def test_model_schema_is_served_and_output_validates(
    name: str, model: LlamaModel, sampler: GrammarSampler
) -> None:
    grammar = schema_grammar(MODELS[name].model_json_schema())
    assert re.search(r"^root ::= ", grammar, re.MULTILINE)
    assert grammar_problem(grammar, model.vocab) is None
    for seed in range(SEEDS):
        text, ended = sampler.generate(grammar, seed)
        assert ended, f"seed {seed}: no end of generation: {text!r}"
        MODELS[name].model_validate_json(text)
