"""Token sampling: greedy, seeded randomness, top-k / top-p / min-p filtering, validation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from pydantic import ValidationError

from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.sampling import TokenSampler

# Known softmax probabilities, placed at scattered ids of a 10-token vocabulary; the
# other ids are impossible (-inf) or practically impossible (very negative).
PROBS = {5: 0.5, 2: 0.3, 7: 0.15, 0: 0.05}
VOCAB = 10


def known_logits() -> np.ndarray:
    logits = np.full(VOCAB, -np.inf)
    logits[[1, 3]] = -1e9
    for token, p in PROBS.items():
        logits[token] = np.log(p)
    return logits


def draw(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    sampler = TokenSampler(params, len(logits))
    return [sampler(logits) for _ in range(n)]


def flat_logits() -> np.ndarray:
    """A flat-ish row: many tokens with similar probability."""
    return np.random.default_rng(7).normal(0.0, 0.1, 32).astype(np.float32)


@pytest.mark.parametrize(
    "logits",
    [
        np.array([0.1, 3.0, -2.0, 2.9]),
        np.array([-5.0, -4.0, -3.0]),
        np.array([1.0, -np.inf, 0.0, 7.5], dtype=np.float32),
    ],
)
def test_greedy_picks_argmax(logits: np.ndarray) -> None:
    """The default (temperature 0) and top_k=1 both pick the highest logit."""
    expected = int(np.argmax(logits))
    assert SamplingParams().greedy
    assert TokenSampler(SamplingParams(), len(logits))(logits) == expected
    top1 = SamplingParams(temperature=1.5, top_k=1, seed=3)
    assert top1.greedy
    assert draw(top1, logits, 20) == [expected] * 20


@pytest.mark.parametrize("seed", [None, 0, 1, 12345])
def test_temperature_zero_is_greedy_regardless_of_seed(seed: int | None) -> None:
    """With temperature 0 the seed plays no part: always the argmax."""
    logits = flat_logits()
    params = SamplingParams(temperature=0.0, seed=seed, top_p=0.5, min_p=0.1)
    assert draw(params, logits, 30) == [int(np.argmax(logits))] * 30


def test_same_seed_same_sequence() -> None:
    """Two samplers with one seed draw the same sequence; the draws do vary."""
    params = SamplingParams(temperature=1.0, seed=42)
    first = draw(params, flat_logits(), 50)
    assert draw(params, flat_logits(), 50) == first
    assert len(set(first)) > 10


def test_different_seeds_different_sequences() -> None:
    """Different seeds give different sequences on a flat row."""
    logits = flat_logits()
    sequences = {tuple(draw(SamplingParams(temperature=1.0, seed=s), logits, 50)) for s in range(5)}
    assert len(sequences) == 5


def test_sampler_state_advances_per_call() -> None:
    """One sampler keeps its own generator: it does not restart at each call."""
    sampler = TokenSampler(SamplingParams(temperature=1.0, seed=0), 32)
    draws = [sampler(flat_logits()) for _ in range(50)]
    assert len(set(draws)) > 10


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_only_yields_k_highest(k: int) -> None:
    """top_k=k samples only (and, at a high temperature, all of) the k best ids."""
    logits = np.random.default_rng(3).normal(0.0, 1.0, 40)
    best = set(np.argsort(logits)[-k:].tolist())
    draws = draw(SamplingParams(temperature=5.0, top_k=k, seed=1), logits, 1500)
    assert set(draws) == best


def test_top_k_larger_than_vocab_keeps_everything() -> None:
    """top_k beyond the vocabulary size filters nothing."""
    logits = np.zeros(6)
    assert set(draw(SamplingParams(temperature=1.0, top_k=50, seed=2), logits, 600)) == set(
        range(6)
    )


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, {5}),
        (0.6, {5, 2}),
        (0.75, {5, 2}),
        (0.85, {5, 2, 7}),
        (0.9, {5, 2, 7}),
        (0.97, {5, 2, 7, 0}),
        (1.0, {5, 2, 7, 0}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_top_p(top_p: float, expected: set[int]) -> None:
    """Probabilities 0.5/0.3/0.15/0.05: the kept ids are the shortest head reaching top_p."""
    draws = draw(SamplingParams(temperature=1.0, top_p=top_p, seed=4), known_logits(), 2000)
    assert set(draws) == expected


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.05, {5, 2, 7, 0}),  # threshold 0.025
        (0.2, {5, 2, 7}),  # threshold 0.1: drops 0.05
        (0.5, {5, 2}),  # threshold 0.25: drops 0.15
        (0.7, {5}),  # threshold 0.35: drops 0.3
        (1.0, {5}),
    ],
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, expected: set[int]) -> None:
    """min_p keeps the tokens with probability ≥ min_p × the highest probability."""
    draws = draw(SamplingParams(temperature=1.0, min_p=min_p, seed=5), known_logits(), 2000)
    assert set(draws) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"top_k": 3, "top_p": 0.99, "min_p": 0.05}, {5, 2, 7}),  # top_k binds
        ({"top_k": 3, "top_p": 0.6, "min_p": 0.05}, {5, 2}),  # top_p binds
        ({"top_k": 4, "top_p": 0.99, "min_p": 0.7}, {5}),  # min_p binds
    ],
)
def test_filters_combine(fields: dict[str, float], expected: set[int]) -> None:
    """top_k, top_p and min_p together: the strictest one decides what is kept."""
    params = SamplingParams(temperature=1.0, seed=6, **fields)
    assert set(draw(params, known_logits(), 2000)) == expected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_tempered_softmax(temperature: float) -> None:
    """Empirical frequencies match softmax(logits / temperature) within a loose tolerance."""
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.log(probs)
    expected = probs ** (1.0 / temperature)
    expected /= expected.sum()
    n = 10000
    counts = Counter(draw(SamplingParams(temperature=temperature, seed=8), logits, n))
    observed = np.array([counts[i] / n for i in range(4)])
    assert sum(counts.values()) == n and set(counts) <= {0, 1, 2, 3}
    np.testing.assert_allclose(observed, expected, atol=0.03)


def test_impossible_tokens_never_drawn() -> None:
    """Tokens at -inf are never sampled, even with no filters at all."""
    draws = draw(SamplingParams(temperature=10.0, seed=9), known_logits(), 2000)
    assert set(draws) <= set(PROBS) and not set(draws) & {1, 3, 4, 6, 8, 9}


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": -1},
        {"temperature": -0.1},
        {"temperature": 10.5},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"min_p": 1.01},
        {"min_p": -0.1},
        {"top_k": -1},
    ],
)
def test_validation_rejects_out_of_range(fields: dict[str, float]) -> None:
    """Out-of-range sampling fields are rejected by pydantic."""
    with pytest.raises(ValidationError):
        SamplingParams(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"temperature": 0.0},
        {"temperature": 10.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"min_p": 0.0},
    ],
)
def test_validation_accepts_bounds(fields: dict[str, float]) -> None:
    """The edges of each range are valid and kept as given."""
    params = SamplingParams(**fields)
    for name, value in fields.items():
        assert getattr(params, name) == value


def test_params_are_frozen() -> None:
    """Sampling parameters cannot be changed after construction."""
    params = SamplingParams()
    with pytest.raises(ValidationError):
        params.temperature = 1.0  # type: ignore[misc]
