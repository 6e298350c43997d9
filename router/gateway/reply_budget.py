"""How many tokens a generation request may ask of the replicas, checked before any of it
reaches one: each choice's reply within the context its prompt leaves (and the server's
`max_tokens_cap`), and the request's whole work within `max_request_tokens`.

A request's work is the token positions its choices may hold in replica slots:
n × Σ over its prompts of (prompt tokens + max_tokens), max_tokens being the most tokens a
choice of that prompt may generate (as asked, or by default the rest of the context). One
chat of n = 16 choices, each filling the context, is 16 × n_ctx: the default budget.

`max_tokens` also sizes llama.cpp's penalty window on the replica (`sampling._chain`), so a
value beyond the context is refused here by arithmetic, before tokenising or rendering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.errors import APIError, invalid_request

GenerationBody = api.ChatCompletionRequest | api.CompletionRequest
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # vLLM's and OpenAI's code


@dataclass(frozen=True)
class ReplyBudget:
    """The bounds of one served model: its context, the cap, the work budget (None: the
    most choices, `MAX_CHOICES`, each filling the context)."""

    n_ctx: int
    max_tokens_cap: int | None = None
    max_request_tokens: int | None = None

    @property
    def work_limit(self) -> int:
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        return api.MAX_CHOICES * self.n_ctx

    def check_asked(self, body: GenerationBody, prompts: int) -> None:
        """Refuse, before any prompt is built, a `max_tokens` over the cap or the context,
        and work over the budget even with one-token prompts."""
        asked = asked_tokens(body)
        if asked is None:
            return
        param = tokens_param(body)
        cap = self.max_tokens_cap
        if cap is not None and asked > cap:
            raise invalid_request(
                f"{param} is {asked}, but this server generates at most {cap} tokens "
                "(its max_tokens_cap setting).",
                param=param,
            )
        if asked >= self.n_ctx:
            raise invalid_request(
                f"{param} is {asked}, but this model's maximum context length is {self.n_ctx} "
                f"tokens: even after a one-token prompt at most {self.n_ctx - 1} can be "
                "generated.",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        self._check_work(body, [1] * prompts, [asked] * prompts)

    def replies(self, body: GenerationBody, prompt_tokens: Sequence[int]) -> list[int]:
        """The most tokens each choice of each prompt (of `prompt_tokens` tokens) may
        generate; refuses an asked `max_tokens` over a prompt's room, and work over the
        budget."""
        replies = [self._reply(body, n, i, len(prompt_tokens)) for i, n in enumerate(prompt_tokens)]
        self._check_work(body, prompt_tokens, replies)
        return replies

    def _reply(self, body: GenerationBody, prompt_tokens: int, index: int, count: int) -> int:
        room = self.n_ctx - prompt_tokens
        asked = asked_tokens(body)
        if asked is None:  # a chat's default: the rest of the context; a completion's: 16
            cap = self.max_tokens_cap
            limit = room if cap is None else min(room, cap)
            default = body.requested_tokens
            return limit if default is None else min(default, limit)
        if asked > room:
            param = tokens_param(body)
            which = f"prompt {index}" if count > 1 else "the prompt"
            raise invalid_request(
                f"{param} is {asked}, but this model's maximum context length is {self.n_ctx} "
                f"tokens and {which} has {prompt_tokens}: at most {room} can be generated.",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        return asked

    def _check_work(
        self, body: GenerationBody, prompt_tokens: Sequence[int], replies: Sequence[int]
    ) -> None:
        work = body.n * (sum(prompt_tokens) + sum(replies))
        if work > self.work_limit:
            raise _too_much_work(body, work, len(prompt_tokens), self.work_limit)


def asked_tokens(body: GenerationBody) -> int | None:
    """`max_tokens` (or `max_completion_tokens`) as the client set it; None when unset (a
    completion's default of 16 is not the client's)."""
    if isinstance(body, api.CompletionRequest) and "max_tokens" not in body.model_fields_set:
        return None
    return body.requested_tokens


def tokens_param(body: GenerationBody) -> str:
    """The field the client limits the reply with."""
    if isinstance(body, api.ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def _too_much_work(body: GenerationBody, work: int, prompts: int, limit: int) -> APIError:
    per = f"{prompts} prompts" if prompts > 1 else "its prompt"
    return invalid_request(
        f"This request may hold {work} tokens in replica slots (n {body.n} × the prompt "
        f"tokens plus {tokens_param(body)} of {per}); this server takes at most {limit} per "
        "request (its max_request_tokens setting).",
        param=tokens_param(body),
    )
