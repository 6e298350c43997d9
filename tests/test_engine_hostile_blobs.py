"""Hostile state blobs never reach llama.cpp: each is rejected, and the engine keeps serving.

A truncated state handed to llama.cpp crashes the process (measured), so this suite feeds
a real engine (real llama.cpp, a generated hybrid model) 200+ damaged, forged and foreign
blobs through the same entry point a peer transfer uses.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import struct

import numpy as np
import pytest

from baton_serve.cache_store.checkpoints.state_blob import HEADER_SIZE, BlobError, seal_payload
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig

HMAC_KEY = b"test-cluster-key"

_SIGNED = struct.Struct("<8sHH32sI16sQ16sB32s")  # the header layout, written out independently
RNG = random.Random(20261121)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A hybrid-model engine holding one real checkpoint, and a llama-model engine."""
    from baton_serve.replicas.models.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("hostile")
    config = EngineConfig(n_ctx=512, n_slots=2, n_threads=2)
    hybrid = Engine(str(write_tiny_model("qwen35", folder / "q.gguf")), config, hmac_key=HMAC_KEY)
    other = Engine(
        str(write_tiny_model("llama", folder / "l.gguf", seed=1)), config, hmac_key=HMAC_KEY
    )
    hybrid.generate(
        hybrid.text_prompt("A prompt whose state is checkpointed. " * 4),
        SamplingParams(max_tokens=4),
    )
    other.generate(other.text_prompt("Another model's state."), SamplingParams(max_tokens=2))
    other.generate(other.text_prompt("Evict the first slot's state."), SamplingParams(max_tokens=2))
    other.generate(other.text_prompt("And the second one."), SamplingParams(max_tokens=2))
    yield hybrid, other
    hybrid.close()
    other.close()


def _valid_parts(engine: Engine) -> tuple[bytes, memoryview]:
    checkpoint = max(engine.checkpoints(), key=lambda c: c.n_tokens)
    parts = engine.export_checkpoint(checkpoint.prefix_hash)
    assert parts is not None
    return parts


def _valid_blob(engine: Engine) -> bytes:
    return b"".join(_valid_parts(engine))


def _resign(blob: bytes, key: bytes = HMAC_KEY, **fields: object) -> bytes:
    """Rewrite header fields and sign again (the header and the token ids): only the field
    checks can catch these."""
    names = (
        "magic",
        "version",
        "flags",
        "fingerprint",
        "n_tokens",
        "prefix_hash",
        "state_len",
        "nonce",
        "lanes",
        "checksum",
    )
    values = dict(zip(names, _SIGNED.unpack_from(blob)))
    values.update(fields)
    signed = _SIGNED.pack(*(values[n] for n in names))
    token_ids = blob[HEADER_SIZE : HEADER_SIZE + 4 * min(int(values["n_tokens"]), 1 << 20)]
    mac = hmac.new(key, signed + token_ids, hashlib.sha256).digest()
    return signed + mac + blob[HEADER_SIZE:]


def _resealed(blob: bytes, state: bytes) -> dict[str, object]:
    """The header fields that seal `state` (as its signer would)."""
    seal = seal_payload(HMAC_KEY, state)
    return {
        "state_len": len(state),
        "nonce": seal.nonce,
        "lanes": seal.lanes,
        "checksum": seal.digest,
    }


def _flip(blob: bytes, bit: int) -> bytes:
    data = bytearray(blob)
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data)


def _cases() -> list[tuple[str, object]]:
    """(name, how to damage a valid blob) — the damage is applied inside the test."""
    cases: list[tuple[str, object]] = [("empty", lambda b, o: b"")]
    for i in range(70):
        cut = RNG.randrange(1, HEADER_SIZE) if i < 20 else None
        cases.append(
            (
                f"truncated-{i}",
                lambda b, o, cut=cut: b[: cut if cut else RNG.randrange(HEADER_SIZE, len(b))],
            )
        )
    for i in range(100):
        region = "header" if i < 30 else "payload"
        cases.append(
            (
                f"bitflip-{region}-{i}",
                lambda b, o, region=region: _flip(
                    b,
                    RNG.randrange(HEADER_SIZE * 8)
                    if region == "header"
                    else RNG.randrange(HEADER_SIZE * 8, len(b) * 8),
                ),
            )
        )
    for i in range(10):
        cases.append(
            (f"forged-key-{i}", lambda b, o, i=i: _resign(b, key=f"attacker-{i}".encode()))
        )
    cases += [
        ("missing-hmac", lambda b, o: b[: HEADER_SIZE - 32] + bytes(32) + b[HEADER_SIZE:]),
        ("other-model", lambda b, o: o),
        ("other-model-relabelled", lambda b, o: _resign(o, fingerprint=b[12:44])),
        ("wrong-version", lambda b, o: _resign(b, version=4)),
        ("version-2-blake3", lambda b, o: _resign(b, version=2)),
        ("lanes-zero", lambda b, o: _resign(b, lanes=0)),
        ("lanes-too-many", lambda b, o: _resign(b, lanes=200)),
        ("lanes-changed", lambda b, o: _resign(b, lanes=2)),
        ("version-zero", lambda b, o: _resign(b, version=0)),
        (
            "version-1-sha256",
            lambda b, o: _resign(b, version=1, checksum=hashlib.sha256(b[HEADER_SIZE:]).digest()),
        ),
        ("unknown-flags", lambda b, o: _resign(b, flags=1)),
        ("bad-magic", lambda b, o: _resign(b, magic=b"PICKLE!!")),
        ("absurd-state-len", lambda b, o: _resign(b, state_len=2**63)),
        ("absurd-n-tokens", lambda b, o: _resign(b, n_tokens=2**32 - 1)),
        ("state-len-plus-one", lambda b, o: _resign(b, state_len=_SIGNED.unpack_from(b)[6] + 1)),
        ("state-len-minus-one", lambda b, o: _resign(b, state_len=_SIGNED.unpack_from(b)[6] - 1)),
        ("n-tokens-minus-one", lambda b, o: _resign(b, n_tokens=_SIGNED.unpack_from(b)[4] - 1)),
        ("zero-tokens", lambda b, o: _resign(b, n_tokens=0)),
        ("trailing-garbage", lambda b, o: b + b"\x00" * 17),
        ("doubled", lambda b, o: b + b),
        ("random-bytes", lambda b, o: RNG.randbytes(len(b))),
        ("header-only", lambda b, o: b[:HEADER_SIZE]),
        ("wrong-prefix-hash", lambda b, o: _resign(b, prefix_hash=bytes(16))),
        (
            "payload-swapped-checksum-kept",
            lambda b, o: b[:HEADER_SIZE] + bytes(len(b) - HEADER_SIZE),
        ),
        (
            "truncated-state-resigned",
            lambda b, o: _resign(
                b[:-100], **_resealed(b, b[HEADER_SIZE + 4 * _SIGNED.unpack_from(b)[4] : -100])
            ),
        ),
    ]
    return cases


CASES = _cases()


def test_there_are_at_least_200_cases() -> None:
    assert len(CASES) >= 200


@pytest.mark.parametrize("parts", [False, True], ids=["contiguous", "parts"])
@pytest.mark.parametrize("name,damage", CASES, ids=[n for n, _ in CASES])
def test_hostile_blob_is_rejected(name, damage, parts, engines) -> None:
    """Each damaged blob arrives whole, or as the two parts a peer sends (cut where the
    valid blob's state begins)."""
    hybrid, other = engines
    stored = hybrid.store_figures().checkpoints
    head_size = len(_valid_parts(hybrid)[0])
    bad = damage(_valid_blob(hybrid), _valid_blob(other))
    with pytest.raises(BlobError) as caught:
        hybrid.import_checkpoint((bad[:head_size], bad[head_size:]) if parts else bad)
    assert caught.value.reason and str(caught.value)  # a machine code and a clear message
    assert hybrid.store_figures().checkpoints == stored  # nothing half-imported


def test_a_writable_blob_is_copied_before_it_is_checked(engines) -> None:
    """What is checked is what llama.cpp gets: a buffer someone else can still write to is
    copied first; a read-only one (Ray's object store) is kept where it is."""
    hybrid, _ = engines
    head, state = _valid_parts(hybrid)
    writable = bytearray(state)
    kept = hybrid.import_checkpoint((head, writable))
    writable[:] = bytes(len(writable))
    assert bytes(kept.state) == bytes(state)
    shared = np.frombuffer(bytes(state), dtype=np.uint8)
    assert not shared.flags.writeable
    kept = hybrid.import_checkpoint((head, shared))
    assert np.shares_memory(np.frombuffer(kept.state, dtype=np.uint8), shared)


def test_engine_still_serves_and_restores_after_the_hostile_suite(engines) -> None:
    """Runs after the parametrized cases (file order): the process and engine are intact."""
    hybrid, _ = engines
    blob = _valid_blob(hybrid)
    checkpoint = hybrid.import_checkpoint(blob)
    prompt = Prompt(
        tokens=tuple(checkpoint.tokens.tolist()) + tuple(hybrid.model.tokenize(" More."))
    )
    done = hybrid.generate(prompt, SamplingParams(max_tokens=3))
    assert done.usage.cached_tokens == checkpoint.n_tokens
    assert len(done.tokens) == 3
