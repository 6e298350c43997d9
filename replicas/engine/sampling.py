"""Token sampling on llama.cpp's own sampler chain (`llama_sampler_*`), one chain per request.

The chain runs on a copy of a logits row (the engine may have split the batch, so a row is
not always still in the context). Its order is llama.cpp's: logit bias, penalties,
top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature, then a seeded draw (or the
highest logit when greedy); with mirostat, temperature and then mirostat's draw. A grammar
is checked the way llama.cpp's `common_sampler` does it: the chain picks a token, and only
when the grammar rejects that token are the candidates filtered by the grammar and the chain
run again — filtering a 49k-token vocabulary on every step would cost more than sampling.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import llama_cpp
import numpy as np

from baton_serve.cache_store.wire.sampling_params import SamplingParams, TokenLogprob
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.grammar_nesting import (
    DEFAULT_MAX_GRAMMAR_NESTING,
    check_grammar_nesting,
)
from baton_serve.replicas.engine.llama_model import LlamaModel

# Same memory layout as llama.cpp's `llama_token_data`.
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
LLAMA_SEEDS = 0xFFFFFFFF  # llama.cpp seeds are 32-bit; this value itself means "random"


class TokenSampler:
    """Samples one token per call for one request; owns its llama.cpp samplers.

    `prompt` feeds the repetition penalty (it counts prompt and reply tokens, as in vLLM);
    presence and frequency penalties count the reply only, as OpenAI defines them. Until
    `params.min_tokens` tokens are accepted, `end_tokens` (the model's end-of-generation
    tokens) and the stop token ids cannot be picked. `n_ctx`, the context a request's prompt
    and reply share, bounds the penalties' windows: no `max_tokens` sizes one beyond it.
    """

    def __init__(
        self,
        params: SamplingParams,
        n_vocab: int,
        *,
        vocab: llama_cpp.llama_vocab_p | None = None,
        prompt: tuple[int, ...] = (),
        end_tokens: tuple[int, ...] = (),
        n_ctx: int | None = None,
        max_grammar_nesting: int = DEFAULT_MAX_GRAMMAR_NESTING,
    ) -> None:
        self.params = params
        self._n_vocab = n_vocab
        ends = {*end_tokens, *params.stop_token_ids} if params.min_tokens else set()
        self._too_early = np.array(sorted(t for t in ends if 0 <= t < n_vocab), dtype=np.int64)
        self._accepted = 0
        self._grammar = (
            _grammar(params.grammar, vocab, max_grammar_nesting) if params.grammar else None
        )
        self._chain = _chain(params, n_vocab, prompt, n_ctx)
        self._argmax_only = llama_cpp.llama_sampler_chain_n(self._chain) == 1 and params.greedy
        owned = [s for s in (self._chain, self._grammar) if s]
        self._finalizer = weakref.finalize(self, _free, owned)

    def __call__(self, logits: np.ndarray) -> int | None:
        """The next token, or None when a grammar allows no token (it is complete and the
        model has no end-of-generation token it could pick)."""
        if self._accepted < self.params.min_tokens and self._too_early.size:
            logits = logits.copy()
            logits[self._too_early] = -np.inf
        if self._argmax_only:  # llama.cpp's lone greedy sampler is an argmax: skip the copy
            token = int(np.argmax(logits))
        else:
            token = self._pick(self._fill(logits))
        if self._grammar is None or self._grammar_allows(token, logits[token]):
            return token
        array = self._fill(logits)  # filter the whole vocabulary, then pick again
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(array))
        if not np.isfinite(self._candidates["logit"][: array.size]).any():
            return None
        return self._pick(array)

    def accept(self, token: int, *, end_of_generation: bool = False) -> None:
        """Record a generated token (penalties count it; the grammar advances over it)."""
        self._accepted += 1
        llama_cpp.llama_sampler_accept(self._chain, token)
        if self._grammar is not None and not end_of_generation:
            llama_cpp.llama_sampler_accept(self._grammar, token)

    def close(self) -> None:
        self._finalizer()

    def _pick(self, array: llama_cpp.llama_token_data_array) -> int:
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        return int(array.data[array.selected].id)

    def _grammar_allows(self, token: int, logit: float) -> bool:
        single = np.array([(token, logit, 0.0)], dtype=TOKEN_DATA)
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(_array_of(single)))
        return bool(np.isfinite(single["logit"][0]))

    @functools.cached_property
    def _candidates(self) -> np.ndarray:
        """Made on first use: a lone greedy sampler never needs it."""
        return np.zeros(self._n_vocab, dtype=TOKEN_DATA)

    def _fill(self, logits: np.ndarray) -> llama_cpp.llama_token_data_array:
        """The candidates (every token, with its logit), as llama.cpp's array over them."""
        candidates = self._candidates
        candidates["id"] = _token_ids(self._n_vocab)
        candidates["logit"] = logits
        candidates["p"] = 0.0
        return _array_of(candidates)


def sampling_problem(params: SamplingParams, model: LlamaModel, config: EngineConfig) -> str | None:
    """What makes `params` unservable on an engine of `config` (a token id outside the
    vocabulary, a grammar nested too deep or that llama.cpp cannot parse), if anything: a
    request's mistake, found before it queues."""
    ids = [token for token, _ in params.logit_bias] + list(params.stop_token_ids)
    bad = [token for token in ids if not 0 <= token < model.n_vocab]
    if bad:
        return f"token id {bad[0]} is not in the vocabulary [0, {model.n_vocab})"
    if params.grammar is not None and params.ignore_eos:
        return "ignore_eos cannot be combined with a grammar (the grammar ends the reply)"
    if params.grammar is not None:
        return grammar_problem(params.grammar, model.vocab, config.max_grammar_nesting)
    return None


def grammar_problem(
    text: str,
    vocab: llama_cpp.llama_vocab_p | None = None,
    max_nesting: int = DEFAULT_MAX_GRAMMAR_NESTING,
) -> str | None:
    """Why llama.cpp's grammar sampler cannot take `text`, if it cannot (parsing needs no
    vocabulary)."""
    try:
        llama_cpp.llama_sampler_free(_parsed_grammar(text, vocab, max_nesting))
    except ValueError as exc:
        return str(exc)
    return None


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """`token`'s log-probability under the model's distribution (before temperature,
    penalties, bias or grammar, as OpenAI and vLLM report it) and the `k` most likely."""
    shifted = logits.astype(np.float64) - np.max(logits)
    logprobs = shifted - np.log(np.sum(np.exp(shifted)))
    if k < logprobs.size:
        top = np.argpartition(logprobs, -k)[-k:] if k > 0 else np.arange(0)
    else:
        top = np.arange(logprobs.size)
    top = top[np.argsort(logprobs[top])[::-1]]
    return TokenLogprob(
        token=token,
        logprob=float(logprobs[token]),
        top=tuple((int(t), float(logprobs[t])) for t in top),
    )


@functools.cache
def _token_ids(n_vocab: int) -> np.ndarray:
    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


def _array_of(candidates: np.ndarray) -> llama_cpp.llama_token_data_array:
    return llama_cpp.llama_token_data_array(
        data=candidates.ctypes.data_as(llama_cpp.llama_token_data_p),
        size=len(candidates),
        selected=-1,
        sorted=False,
    )


def _penalty_windows(
    params: SamplingParams, prompt: tuple[int, ...], n_ctx: int | None
) -> tuple[int, int]:
    """How many tokens the repetition penalty (prompt and reply) and the presence and
    frequency penalties (the reply) look back over: all a request can have. llama.cpp
    allocates each window as a ring buffer of that many tokens, so it is bounded by the
    context, where the reply ends at the latest (`max_tokens` 2**31 - 1 once asked 8 GiB)."""
    whole = len(prompt) + params.max_tokens
    reply = params.max_tokens
    if n_ctx is not None:
        whole = min(whole, n_ctx)
        reply = min(reply, n_ctx - len(prompt))
    return whole, max(reply, 1)


def _chain(
    params: SamplingParams, n_vocab: int, prompt: tuple[int, ...], n_ctx: int | None
) -> ctypes.c_void_p:
    chain_params = llama_cpp.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(chain_params)

    def add(sampler: ctypes.c_void_p) -> None:
        llama_cpp.llama_sampler_chain_add(chain, sampler)

    if params.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
    whole, reply = _penalty_windows(params, prompt, n_ctx)
    if params.repetition_penalty != 1.0:
        repetition = llama_cpp.llama_sampler_init_penalties(
            n_vocab, whole, params.repetition_penalty, 0.0, 0.0
        )
        for token in prompt:
            llama_cpp.llama_sampler_accept(repetition, token)
        add(repetition)
    if params.presence_penalty or params.frequency_penalty:
        add(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                reply,
                1.0,
                params.frequency_penalty,
                params.presence_penalty,
            )
        )
    if params.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    seed = LLAMA_SEEDS if params.seed is None else params.seed % LLAMA_SEEDS
    if params.mirostat:
        add(llama_cpp.llama_sampler_init_temp(params.temperature))
        tau, eta = params.mirostat_tau, params.mirostat_eta
        if params.mirostat == 1:
            add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, tau, eta, 100))
        else:
            add(llama_cpp.llama_sampler_init_mirostat_v2(seed, tau, eta))
        return chain
    if params.top_n_sigma > 0:
        add(llama_cpp.llama_sampler_init_top_n_sigma(params.top_n_sigma))
    if params.top_k:
        add(llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.typical_p < 1.0:
        add(llama_cpp.llama_sampler_init_typical(params.typical_p, 1))
    if params.top_p < 1.0:
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p:
        add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    if params.xtc_probability and params.xtc_threshold <= 0.5:
        xtc = llama_cpp.llama_sampler_init_xtc
        add(xtc(params.xtc_probability, params.xtc_threshold, 1, seed))
    add(llama_cpp.llama_sampler_init_temp(params.temperature))
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def _grammar(text: str, vocab: llama_cpp.llama_vocab_p | None, max_nesting: int) -> ctypes.c_void_p:
    if vocab is None:
        raise ValueError("a grammar needs the model's vocabulary")
    return _parsed_grammar(text, vocab, max_nesting)


def _parsed_grammar(
    text: str, vocab: llama_cpp.llama_vocab_p | None, max_nesting: int
) -> ctypes.c_void_p:
    """llama.cpp's grammar sampler for `text`; `ValueError` if it cannot be made. The one
    way a grammar reaches native code: its nesting is counted first, since llama.cpp's
    parser recurses once per group with no bound of its own (`grammar_nesting`)."""
    check_grammar_nesting(text, max_nesting)
    try:
        encoded = text.encode()
    except UnicodeEncodeError:
        raise ValueError("the grammar is not valid text (a lone surrogate)") from None
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, encoded, b"root")
    if not sampler:
        raise ValueError("llama.cpp could not parse the grammar (its log says where)")
    return sampler


def _free(samplers: list[ctypes.c_void_p]) -> None:
    for sampler in samplers:
        llama_cpp.llama_sampler_free(sampler)
