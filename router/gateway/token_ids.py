"""Token ids a client names (`logit_bias` keys, `stop_token_ids`), checked against the
served vocabulary before a replica builds anything from them.

`logit_bias` keys are JSON strings parsed as integers, and Python's `int` reads one id
under many spellings ("1", "01", "+1", " 1", "1_0" is 10): the same id given twice is
refused, so a body cannot multiply one token into entries (each is built into a ctypes
array per choice on the replica's engine thread) beyond the vocabulary's size and the
count `max_logit_bias` bounds as sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from baton_serve.router.gateway.errors import invalid_request


def logit_bias_pairs(biases: Mapping[str, float], n_vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as JSON object keys) as (id, bias) pairs; a key that
    is no integer, an id outside the vocabulary, or one id given twice gets a 400."""
    spelled: dict[int, str] = {}
    for key in biases:
        try:
            token = int(key)
        except ValueError:
            raise invalid_request(
                "logit_bias keys must be token ids (integers as strings).", param="logit_bias"
            ) from None
        if token in spelled:
            raise invalid_request(
                f"logit_bias gives token id {token} twice ({spelled[token]!r} and {key!r}).",
                param="logit_bias",
            )
        spelled[token] = key
    ids = in_vocabulary(list(spelled), n_vocab, "logit_bias")
    return tuple(zip(ids, biases.values(), strict=True))


def in_vocabulary(ids: Sequence[int], n_vocab: int, param: str) -> list[int]:
    """`ids`, each in [0, n_vocab), or a 400 naming the first that is not."""
    bad = [token for token in ids if not 0 <= token < n_vocab]
    if bad:
        raise invalid_request(
            f"{param}: token id {bad[0]} is not in the vocabulary [0, {n_vocab}).", param=param
        )
    return list(ids)
