import random
import threading

import numpy as np
import pytest

from baton_serve.cache_store.checkpoints.checkpoint_store import Checkpoint, CheckpointStore
from baton_serve.cache_store.prefix_hash import PrefixHasher

HASHER = PrefixHasher(b"model-a", block_tokens=4)


def checkpoint(tokens: list[int], state_bytes: int = 100) -> Checkpoint:
    return Checkpoint(HASHER.prefix_hash(tokens), np.array(tokens), bytes(state_bytes))


def named(name: int, state_bytes: int = 96) -> Checkpoint:
    """A one-token checkpoint of exactly ``state_bytes + 4`` bytes."""
    return checkpoint([name], state_bytes)


def test_checkpoint_sizes_and_copies_tokens() -> None:
    tokens = np.array([1, 2, 3], dtype=np.int64)
    cp = Checkpoint(b"h" * 16, tokens, b"abcd")
    tokens[0] = 99
    assert cp.tokens.dtype == np.int32 and cp.tokens.tolist() == [1, 2, 3]
    assert cp.n_tokens == 3 and cp.nbytes == 4 + 12
    with pytest.raises(ValueError):
        Checkpoint(b"h" * 16, np.array([], dtype=np.int32), b"abcd")


def test_budget_never_exceeded_under_random_ops() -> None:
    rng = random.Random(11)
    budget = 5_000
    store = CheckpointStore(budget)
    names = list(range(40))
    for _ in range(1_000):
        name = rng.choice(names)
        if rng.random() < 0.6:
            cp = named(name, rng.randrange(0, 2_000))
            assert store.put(cp) == (cp.nbytes <= budget)
        else:
            store.get(named(name).prefix_hash)
        stored = store.checkpoints()
        assert store.used_bytes == sum(c.nbytes for c in stored) <= budget
        assert len(store) == len(stored) == len({c.prefix_hash for c in stored})


def test_lru_order_get_protects_entry() -> None:
    store = CheckpointStore(300)
    a, b, c, d = (named(i) for i in range(4))
    for cp in (a, b, c):
        assert store.put(cp)
    assert store.get(a.prefix_hash) is a
    assert store.put(d)  # evicts b, the least recently used
    assert b.prefix_hash not in store
    assert store.checkpoints() == [c, a, d]


def test_oversize_put_is_refused_and_keeps_entries() -> None:
    evicted: list[Checkpoint] = []
    store = CheckpointStore(300, on_evict=evicted.append)
    a, b = named(0), named(1)
    store.put(a)
    store.put(b)
    assert not store.put(named(2, 400))
    assert not store.put(named(0, 400))  # not even as a replacement
    assert store.checkpoints() == [a, b] and store.used_bytes == 200 and evicted == []


def test_zero_budget_stores_nothing() -> None:
    store = CheckpointStore(0)
    assert not store.put(named(0, 0))
    assert len(store) == 0 and store.used_bytes == 0


def test_negative_budget_rejected() -> None:
    with pytest.raises(ValueError):
        CheckpointStore(-1)


def test_replacement_adjusts_used_bytes() -> None:
    evicted: list[Checkpoint] = []
    store = CheckpointStore(1_000, on_evict=evicted.append)
    store.put(named(0, 96))
    store.put(named(1, 96))
    bigger = named(0, 496)
    assert store.put(bigger)
    assert store.used_bytes == 600 and len(store) == 2
    assert store.get(bigger.prefix_hash) is bigger
    assert store.put(named(0, 46))
    assert store.used_bytes == 150 and evicted == []


def test_on_evict_gets_evicted_entries_only() -> None:
    evicted: list[Checkpoint] = []
    store = CheckpointStore(300, on_evict=evicted.append)
    a, b, c = named(0), named(1), named(2)
    for cp in (a, b, c):
        store.put(cp)
    assert store.remove(c.prefix_hash) is c
    assert store.remove(c.prefix_hash) is None
    big = named(3, 246)  # 250 bytes: needs both a and b gone
    assert store.put(big)
    assert evicted == [a, b]
    assert store.checkpoints() == [big] and store.used_bytes == 250


def test_longest_match() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(1_000) for _ in range(40)]
    store = CheckpointStore(100_000)
    for n in (3, 8, 13, 30):
        store.put(checkpoint(tokens[:n]))
    other = list(tokens[:20])
    other[17] += 1
    store.put(checkpoint(other))  # 20 tokens, not a prefix of `tokens`
    store.put(checkpoint([*tokens[:12], 7, 7]))  # diverges after 12

    def matched(query: list[int], max_tokens: int) -> list[int] | None:
        match = store.longest_match(HASHER, query, max_tokens)
        return None if match is None else match.tokens.tolist()

    assert matched(tokens, 40) == tokens[:30]
    assert matched(tokens, 29) == tokens[:13]
    assert matched(tokens[:25], 100) == tokens[:13]
    assert matched(tokens, 12) == tokens[:8]
    assert matched(tokens, 2) is None
    assert matched([999_999, *tokens[1:]], 40) is None
    assert matched(other, 40) == other
    assert store.longest_match(HASHER, np.array(tokens), 40) is not None


def test_longest_match_marks_used() -> None:
    store = CheckpointStore(1_000)
    prefix = checkpoint([1, 2, 3])
    store.put(prefix)
    store.put(checkpoint([9]))
    assert store.longest_match(HASHER, [1, 2, 3, 4], 10) is prefix
    assert store.checkpoints()[-1] is prefix


def test_longest_match_guards_against_hash_collisions() -> None:
    store = CheckpointStore(1_000)
    tokens = [1, 2, 3, 4, 5]
    forged = Checkpoint(HASHER.prefix_hash(tokens, 3), np.array([7, 7, 7]), b"state")
    store.put(forged)
    assert store.longest_match(HASHER, tokens, 10) is None


def test_thread_safety_smoke() -> None:
    budget = 20_000
    evicted: list[Checkpoint] = []
    store = CheckpointStore(budget, on_evict=evicted.append)
    base = list(range(64))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                n = rng.randrange(1, 64)
                action = rng.random()
                if action < 0.5:
                    store.put(checkpoint(base[:n], rng.randrange(500, 3_000)))
                elif action < 0.8:
                    match = store.longest_match(HASHER, base, n)
                    assert match is None or match.tokens.tolist() == base[: match.n_tokens]
                elif action < 0.9:
                    store.remove(HASHER.prefix_hash(base, n))
                else:
                    store.get(HASHER.prefix_hash(base, n))
                assert store.used_bytes <= budget
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stored = store.checkpoints()
    assert store.used_bytes == sum(cp.nbytes for cp in stored) <= budget
    assert len({cp.prefix_hash for cp in stored}) == len(stored)


def test_longest_shared_prefix_finds_partial_overlaps() -> None:
    store = CheckpointStore(10_000)
    a = Checkpoint(
        prefix_hash=b"a" * 16, tokens=np.array([1, 2, 3, 4, 5], dtype=np.int32), state=b"x"
    )
    b = Checkpoint(prefix_hash=b"b" * 16, tokens=np.array([1, 2, 9], dtype=np.int32), state=b"y")
    store.put(a)
    store.put(b)
    assert store.longest_shared_prefix([1, 2, 3, 7, 7, 7], 10) == (a, 3)
    assert store.longest_shared_prefix([1, 2, 3, 4, 5, 6], 4) == (a, 4)  # capped
    assert store.longest_shared_prefix([9, 9], 10) == (None, 0)
    store.longest_shared_prefix([1, 2, 9, 9], 10, touch=False)
    assert store.checkpoints()[-1] is a  # looking without touching keeps the LRU order
