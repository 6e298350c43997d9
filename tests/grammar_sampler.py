"""Sampling under a GBNF grammar with llama.cpp's own grammar sampler, token by token, on a
real context: the structured-output corpus tests share it."""

from __future__ import annotations

import llama_cpp

from baton_serve.replicas.engine.llama_model import LlamaModel

MAX_TOKENS = 400
CLOSING_BIAS = 8.0


class GrammarSampler:
    """Generates with llama.cpp's grammar sampler on a real context, token by token.

    A random-weight model at temperature 1 almost never picks one of the few tokens that
    close a string among the ~49,000 the grammar allows inside it, so an unbounded string
    runs on for thousands of tokens. The chain therefore adds `CLOSING_BIAS` to the logits
    of tokens starting with `"`: the grammar still decides which tokens are allowed (and the
    output is validated all the same); the bias only keeps strings short.
    """

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        closing = [
            t for t in range(model.n_vocab) if model.token_bytes(t)[:1] in (b'"', b"]", b"}")
        ]
        self.bias = (llama_cpp.llama_logit_bias * len(closing))(
            *(llama_cpp.llama_logit_bias(t, CLOSING_BIAS) for t in closing)
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = MAX_TOKENS + 8
        params.n_threads = params.n_threads_batch = 2
        self.ctx = llama_cpp.llama_init_from_model(model.pointer, params)
        assert self.ctx

    def generate(self, grammar: str, seed: int) -> tuple[str, bool]:
        """Text sampled under `grammar` (grammar, temperature 1, dist(seed)), and whether it
        ended on an end-of-generation token rather than the token cap."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        grammar_sampler = llama_cpp.llama_sampler_init_grammar(
            self.model.vocab, grammar.encode(), b"root"
        )
        assert grammar_sampler
        for sampler in (
            grammar_sampler,
            llama_cpp.llama_sampler_init_logit_bias(self.model.n_vocab, len(self.bias), self.bias),
            llama_cpp.llama_sampler_init_temp(1.0),
            llama_cpp.llama_sampler_init_dist(seed),
        ):
            llama_cpp.llama_sampler_chain_add(chain, sampler)  # the chain owns them
        token, out = self.model.bos_token or 0, []
        try:
            for _ in range(MAX_TOKENS):
                batch = (llama_cpp.llama_token * 1)(token)
                assert (
                    llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(batch, 1)) == 0
                )
                # `llama_sampler_sample` also accepts the token into every sampler of the
                # chain: accepting it again would advance the grammar twice (and abort).
                token = llama_cpp.llama_sampler_sample(chain, self.ctx, -1)
                if self.model.is_end_of_generation(token):
                    return self.model.detokenize(out), True
                out.append(token)
            return self.model.detokenize(out), False
        finally:
            llama_cpp.llama_sampler_free(chain)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
