"""The emulated engine: the real `Engine` over an emulated context (compute replaced by time
from a profile), against the real engine on the same token prompts, and behind the real
gateway, router and index in a Serve app.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict

import httpx
import numpy as np
import pytest
from fixtures_ray import wait_healthy
from plot_files import assert_png
from ray import serve

from baton_serve.cache_store.checkpoints.state_blob import BlobError
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.route_plan import RoutePlan
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import build_app
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.loadtests.emulated_routing import Measured, figures, format_report
from baton_serve.loadtests.plots import emulated_plots
from baton_serve.loadtests.serve_app import replica_stats, wait_idle
from baton_serve.replicas.engine.emulated_compute import EmulatedContext, EmulatedModel
from baton_serve.replicas.engine.emulated_timing import EmulatedTiming
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_context import BatchEntry, ContextParams, StateRestoreError
from baton_serve.replicas.replica import Replica
from baton_serve.replicas.shipping import ShipPolicy

HMAC_KEY = b"test-cluster-key"
FAST = EmulatedTiming(
    name="test",
    prefill_tokens_per_s=20_000.0,
    decode_tokens_per_s=2_000.0,
    batch_decode_tokens_per_s=4_000.0,
    batch_slots=2,
    state_bytes_per_token=1000,
    restore_bytes_per_s=1e9,
)
SETTINGS = {"n_ctx": 1024, "n_slots": 2, "n_threads": 2, "block_tokens": 16}
SETTINGS |= {"prefill_chunk": 64, "checkpoint_interval": 64}
REPLY = SamplingParams(max_tokens=6, ignore_eos=True)


def _request(
    tokens: tuple[int, ...], plan: RoutePlan | None = None, sampling: SamplingParams = REPLY
) -> ReplicaRequest:
    """A replica request for `tokens` (token ids), with the router's plan if any."""
    generation = GenerationRequest(prompt=Prompt(tokens=tokens), sampling=sampling)
    return ReplicaRequest(generation=generation, plan=plan)


def _pull_plan(tokens: int, ready_in_s: float, busy_s: float = 0.0) -> RoutePlan:
    """The router's plan for "taker": pull `tokens` from "donor", ready in `ready_in_s`;
    the taker could compute them itself in `busy_s` at the earliest (0: at once)."""
    return RoutePlan(
        replica_id="taker",
        kind="pull",
        reused_tokens=tokens,
        donor_id="donor",
        donor_tokens=tokens,
        ready_at=time.time() + ready_in_s,
        start_at=time.time() + busy_s if busy_s else 0.0,
    )


@contextlib.contextmanager
def _donor_and_taker(
    path: str, config: EngineConfig, policy: ShipPolicy | None = None
) -> Iterator[tuple[Replica, Replica]]:
    """Two in-process replicas on engines of `config`: "donor", and "taker" pulling from it
    directly (shipping `policy`, or the default)."""
    with (
        Engine(path, config, hmac_key=HMAC_KEY) as donor_engine,
        Engine(path, config, hmac_key=HMAC_KEY) as taker_engine,
    ):
        donor = Replica("donor", donor_engine)
        yield donor, Replica("taker", taker_engine, peers=_DirectPeer(donor), policy=policy)


def _engine(path: object, *, emulated: bool, **config: object) -> Engine:
    settings = SETTINGS | config | ({"emulated": FAST} if emulated else {})
    return Engine(str(path), EngineConfig(**settings), hmac_key=HMAC_KEY)


def _turns(n_vocab: int, turns: int = 3) -> list[Prompt]:
    """A conversation's prompts as token ids, each the previous one and a new message
    (independent of the replies, so two engines are sent the same prompts)."""
    rng = np.random.default_rng(7)
    tokens: list[int] = []
    prompts = []
    for size in [150, *([40] * (turns - 1))]:
        tokens += rng.integers(1, n_vocab, size).tolist()
        prompts.append(Prompt(tokens=tuple(tokens)))
    return prompts


def test_the_emulated_engine_is_deterministic_and_labelled(tiny_model) -> None:
    path = tiny_model("llama")
    with _engine(path, emulated=True) as one, _engine(path, emulated=True) as other:
        assert one.model.device == "emulated:test"
        prompt = _turns(one.model.n_vocab, 1)[0]
        first = one.generate(prompt, REPLY)
        assert len(first.tokens) == REPLY.max_tokens
        assert other.generate(prompt, REPLY).tokens == first.tokens  # another engine
        sampled = REPLY.model_copy(update={"temperature": 1.0, "seed": 3})
        again = one.generate(prompt, sampled)  # from the cache, sampled: still the same
        assert again.tokens == first.tokens and again.usage.cached_tokens > 0
        changed = Prompt(tokens=prompt.tokens[:-1] + ((prompt.tokens[-1] + 1) % 100,))
        assert other.generate(changed, REPLY).tokens != first.tokens


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_its_cache_counts_are_the_real_engines(arch, tiny_model) -> None:
    """Cached tokens per turn, checkpoints saved and prompt tokens computed: the same
    bookkeeping, whatever the compute (attention, and a hybrid with its checkpoints)."""
    path = tiny_model(arch)
    with _engine(path, emulated=False) as real, _engine(path, emulated=True) as emulated:
        assert emulated.kind is real.kind
        for prompt in _turns(real.model.n_vocab):
            served = [engine.generate(prompt, REPLY).usage for engine in (real, emulated)]
            assert served[0] == served[1]
            assert real.wait_idle(10) and emulated.wait_idle(10)
        for name in ("checkpoints_saved", "prompt_tokens_computed", "replayed_tokens"):
            assert getattr(real.stats, name) == getattr(emulated.stats, name), name
        assert len(real.checkpoints()) == len(emulated.checkpoints())


def test_a_state_blob_round_trips_and_is_checked_like_a_real_one(tiny_model) -> None:
    path = tiny_model("llama")
    with (
        _engine(path, emulated=True) as donor,
        _engine(path, emulated=True) as taker,
        _engine(path, emulated=False) as real,
    ):
        prompt = _turns(donor.model.n_vocab, 1)[0]
        reply = donor.generate(prompt, REPLY)
        assert donor.wait_idle(10)
        head, state = donor.export_best(prompt.tokens)[0]
        checkpoint = taker.import_checkpoint((head, state))
        assert taker.state_bytes(len(checkpoint.tokens)) == len(state)
        pulled = taker.generate(prompt, REPLY)
        assert pulled.tokens == reply.tokens and pulled.usage.cached_tokens > 0
        tampered = bytearray(state)
        tampered[-1] ^= 1
        with pytest.raises(BlobError):
            taker.import_checkpoint((head, bytes(tampered)))
        with pytest.raises(BlobError, match="bytes"):  # not a real state's size
            real.import_checkpoint((head, state))


def test_a_peer_asking_during_a_replay_gets_the_whole_conversation(tiny_model) -> None:
    """An agent's next step reaches another replica while the donor still replays the
    last reply (an attention slot's conversation is stored only when its replay ends): the
    donor waits for it instead of handing over the previous turn's shorter state."""
    slow = FAST.model_copy(update={"prefill_tokens_per_s": 300.0})  # replays take ~0.8 s
    config = EngineConfig(**SETTINGS | {"emulated": slow})
    path = str(tiny_model("llama"))
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    with (
        Engine(path, config, hmac_key=HMAC_KEY) as donor,
        Engine(path, config, hmac_key=HMAC_KEY) as taker,
    ):
        replica = Replica("donor", donor)
        first, added = _turns(donor.model.n_vocab, 2)

        async def ask_during_the_second_replay() -> tuple[int, int, float, object]:
            one = await replica.generate(_request(first.tokens, sampling=params))
            assert await asyncio.to_thread(donor.wait_idle, 10)  # turn one stored, replayed
            second = first.tokens + tuple(one.tokens) + added.tokens[len(first) :]
            two = await replica.generate(_request(second, sampling=params))
            history = second + tuple(two.tokens)
            asked = history + (5, 6, 7)  # the next step: the conversation and a tool result
            replaying = donor.replay_share(asked)
            started = time.perf_counter()
            blob = await replica.export_when_ready(asked, 0, wait_s=10.0)
            return replaying, len(history), time.perf_counter() - started, blob

        replaying, history, waited, blob = asyncio.run(ask_during_the_second_replay())
        assert replaying == history
        assert 0.1 < waited < 5.0  # the replay's end, not the deadline
        assert len(taker.import_checkpoint(blob).tokens) == history  # not turn one's state


class _DirectPeer:
    """Reaches a donor `Replica` in this process: its own `export_when_ready`, no Ray (the
    emulated engines' step times are what this test needs to control)."""

    def __init__(self, donor: Replica) -> None:
        self.donor = donor

    async def fetch(self, replica_id, tokens, min_tokens, wait_s=0.0):
        return await self.donor.export_when_ready(tokens, min_tokens, wait_s)

    async def offer(self, replica_id, blob) -> bool:
        return False


@pytest.mark.parametrize(
    ("own_prefill", "waits_on"),
    [(None, True), (5_000.0, False)],
    ids=["recompute-slower-waits-on", "recompute-faster-gives-up"],
)
def test_a_pull_past_its_deadline_waits_on_while_the_donor_still_computes(
    own_prefill, waits_on, tiny_model
) -> None:
    """The router planned a pull of a prefix the donor is computing, expected in 0.2 s; the
    donor runs late (it needs ~2 s more). At the puller's deadline the donor says how far
    it is, and the puller — its wait spent — waits on while the rest beats computing the
    prefix itself (~3 s), instead of computing it all again after the wait; a puller that
    computes faster than the rest of the wait gives up at the deadline, as before."""
    slow = FAST.model_copy(update={"prefill_tokens_per_s": 300.0})  # the prompt: ~3 s
    config = EngineConfig(**SETTINGS | {"emulated": slow})
    path = str(tiny_model("qwen35"))
    policy = ShipPolicy(deadline_s=0.3)
    if own_prefill is not None:  # the puller's own measured speed, as if known already
        policy = ShipPolicy(deadline_s=0.3, prefill_tokens_per_s=own_prefill)
    with _donor_and_taker(path, config, policy) as (donor, taker):
        donor_engine, taker_engine = donor.engine, taker.engine
        rng = np.random.default_rng(11)
        prompt = tuple(rng.integers(1, donor_engine.model.n_vocab, 900).tolist())
        held = max(donor_engine.checkpoint_positions(Prompt(tokens=prompt)))

        async def pull_while_the_donor_computes() -> int:
            await donor.generate(_request(tuple(range(1, 200))))  # measures its own speed
            computing = asyncio.ensure_future(donor.generate(_request(prompt)))
            await asyncio.sleep(1.0)  # a third of it computed
            plan = _pull_plan(held, ready_in_s=0.2)  # the router's estimate: far too early
            done = await taker.generate(_request(prompt + (7, 8, 9), plan))
            await computing
            return done.usage.cached_tokens

        cached = asyncio.run(pull_while_the_donor_computes())
    if waits_on:
        assert taker.stats.pull_waits_extended >= 1
        # at least the last checkpoint it planned; the peer's ask saves where the prompts part
        assert taker.stats.pulls == 1 and cached >= held
        assert taker_engine.stats.prompt_tokens_computed == len(prompt) + 3 - cached
    else:
        assert taker.stats.pull_waits_extended == 0 and taker.stats.pulls == 0
        assert cached == 0 and taker.stats.replans == {"donor_miss": 1}
        assert taker_engine.stats.prompt_tokens_computed == len(prompt) + 3


def test_a_busy_puller_waits_for_the_donor_until_it_could_have_computed_the_prefix(
    tiny_model,
) -> None:
    """A taker that computes the prefix faster than the donor's rest (as in the case above
    that gives up) but was busy, the router's plan says, for 4 s: the donor's state, ready
    in about 2 s, comes before it could have computed the prefix itself, so it waits on and
    pulls it instead of computing it a second time."""
    slow = FAST.model_copy(update={"prefill_tokens_per_s": 300.0})  # the prompt: ~3 s
    config = EngineConfig(**SETTINGS | {"emulated": slow})
    policy = ShipPolicy(deadline_s=0.3, prefill_tokens_per_s=5_000.0)
    with _donor_and_taker(str(tiny_model("qwen35")), config, policy) as (donor, taker):
        rng = np.random.default_rng(11)
        prompt = tuple(rng.integers(1, donor.engine.model.n_vocab, 900).tolist())
        held = max(donor.engine.checkpoint_positions(Prompt(tokens=prompt)))

        async def pull_while_busy() -> int:
            await donor.generate(_request(tuple(range(1, 200))))
            computing = asyncio.ensure_future(donor.generate(_request(prompt)))
            await asyncio.sleep(1.0)
            plan = _pull_plan(held, ready_in_s=0.2, busy_s=4.0)
            done = await taker.generate(_request(prompt + (7, 8, 9), plan))
            await computing
            return done.usage.cached_tokens

        cached = asyncio.run(pull_while_busy())
    assert taker.stats.pulls == 1 and cached >= held and taker.stats.replans == {}


def test_a_pull_from_a_donor_whose_prefill_stalls_gives_up_and_computes(
    tiny_model, monkeypatch
) -> None:
    """The donor of a planned pull stops computing mid-prompt (its engine's step hangs: a
    fault injected into the emulated compute, as a wedged device or a starved host would
    cause). At the deadline it says how far it is and the puller waits on once; the next
    answer shows no progress, so the puller gives up and computes the prompt itself — it
    does not wait on the stalled donor, which is still stuck when the request is answered."""
    slow = FAST.model_copy(update={"prefill_tokens_per_s": 300.0})  # the prompt: ~3 s
    config = EngineConfig(**SETTINGS | {"emulated": slow})
    path = str(tiny_model("qwen35"))
    with _donor_and_taker(path, config, ShipPolicy(deadline_s=0.3)) as (donor, taker):
        donor_engine, taker_engine = donor.engine, taker.engine
        rng = np.random.default_rng(13)
        prompt = tuple(rng.integers(1, donor_engine.model.n_vocab, 900).tolist())
        held = max(donor_engine.checkpoint_positions(Prompt(tokens=prompt)))
        stalled, release = threading.Event(), threading.Event()
        donor_context = donor_engine._context
        step = donor_context._sleep

        def stall_when_told(seconds: float) -> None:
            if stalled.is_set():
                assert release.wait(60), "the test never released the donor"
            step(seconds)

        monkeypatch.setattr(donor_context, "_sleep", stall_when_told)

        async def pull_from_a_stalled_donor() -> tuple[int, float, bool]:
            await donor.generate(_request(tuple(range(1, 200))))
            computing = asyncio.ensure_future(donor.generate(_request(prompt)))
            await asyncio.sleep(1.0)  # a third of it computed
            stalled.set()
            plan = _pull_plan(held, ready_in_s=0.2)
            started = time.perf_counter()
            done = await taker.generate(_request(prompt + (7, 8, 9), plan))
            took = time.perf_counter() - started
            still_stuck = not computing.done()
            release.set()
            await computing
            return done.usage.cached_tokens, took, still_stuck

        cached, took, still_stuck = asyncio.run(pull_from_a_stalled_donor())
    assert still_stuck  # the taker's answer did not wait for the donor
    assert taker.stats.pull_waits_extended == 1 and taker.stats.pulls == 0
    assert cached == 0 and taker.stats.replans == {"donor_miss": 1}
    assert taker_engine.stats.prompt_tokens_computed == len(prompt) + 3
    # the deadline, one extension (at most its own prefill time) and its own prefill
    assert took < 0.3 + 2 * (len(prompt) + 3) / 300.0 + 1.0


def test_a_peer_waiting_for_a_prefix_gets_it_saved_where_the_prompts_part(tiny_model) -> None:
    """A token-id prompt on an attention model has no known system-prompt end, so its engine
    stores it only when its reply's replay ends. A peer planned to pull the 500 tokens its
    own prompt shares with it (in flight, expected soon) would wait past its deadline; asked
    for them, the donor's prefill saves its state at the 500th token too, and the peer pulls
    that while the donor is still computing."""
    slow = FAST.model_copy(update={"prefill_tokens_per_s": 200.0})  # 1,000 tokens: ~5 s
    config = EngineConfig(**SETTINGS | {"emulated": slow})
    path = str(tiny_model("llama"))
    with _donor_and_taker(path, config) as (donor, taker):
        donor_engine = donor.engine
        rng = np.random.default_rng(12)
        shared = tuple(rng.integers(1, donor_engine.model.n_vocab, 500).tolist())
        own = tuple(rng.integers(1, donor_engine.model.n_vocab, 500).tolist())
        theirs = tuple(rng.integers(1, donor_engine.model.n_vocab, 60).tolist())
        assert donor_engine.checkpoint_positions(Prompt(tokens=shared + own)) == []

        async def pull_while_the_donor_computes() -> tuple[int, float]:
            await donor.generate(_request(tuple(range(1, 200))))  # measures its own speed
            computing = asyncio.ensure_future(donor.generate(_request(shared + own)))
            await asyncio.sleep(0.3)
            plan = _pull_plan(500, ready_in_s=2.2)  # the donor's prefill passes the 500th token
            done = await taker.generate(_request(shared + theirs, plan))
            donor_busy = not computing.done()
            await computing
            return done.usage.cached_tokens, donor_busy

        cached, donor_busy = asyncio.run(pull_while_the_donor_computes())
    assert taker.stats.pulls == 1 and taker.stats.replans == {}
    assert cached == 500 and donor_busy  # pulled before the donor's prompt was done


def test_the_context_refuses_what_llama_cpp_refuses(tiny_model) -> None:
    model = EmulatedModel(str(tiny_model("llama")), FAST)
    try:
        context = EmulatedContext(model, ContextParams(64, 2, 32, 1))
        context.decode([BatchEntry(0, 5, 0, False), BatchEntry(0, 6, 1, True)])
        state = context.save_state(0)
        context.restore_state(1, state)
        assert context.held(1) == (5, 6)
        forged = bytearray(state)
        forged[-4:] = (7).to_bytes(4, "little")  # another token under the same digest
        with pytest.raises(StateRestoreError):
            context.restore_state(1, bytes(forged))
        assert context.held(1) == ()
        with pytest.raises(RuntimeError, match="invalid batch"):  # a gap in positions
            context.decode([BatchEntry(0, 5, 5, True)])
        context.decode([BatchEntry(0, 1, p, False) for p in range(2, 34)])
        with pytest.raises(RuntimeError, match="no free KV cache slot"):  # past 64 tokens
            context.decode([BatchEntry(0, 1, p, False) for p in range(34, 66)])
    finally:
        model.close()


def test_a_step_takes_the_profiles_time(tiny_model) -> None:
    slow = FAST.model_copy(update={"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 50.0})
    config = EngineConfig(**SETTINGS, emulated=slow)
    with Engine(str(tiny_model("llama")), config, hmac_key=HMAC_KEY) as engine:
        prompt = _turns(engine.model.n_vocab, 1)[0]
        started = time.perf_counter()
        done = engine.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        took = time.perf_counter() - started
        expected = len(prompt) / 1000.0 + 4 / 50.0  # the prompt, then 4 decode steps
        assert expected <= took < expected + 0.15
        assert done.ttft_s == pytest.approx(len(prompt) / 1000.0, abs=0.05)


def test_a_policy_whose_every_request_failed_is_reported_not_raised() -> None:
    failed = [Measured("chat", None, 100, 0, 100, error="no reply within 300 s")] * 3
    found = figures(failed)
    assert found["errors"] == 3 and found["ttft_p99_s"] is None
    assert found["error_kinds"] == ["no reply within 300 s"]
    pair = {"emulated": found | {"pulls": 0, "wall_s": 1.0, "devices": []}}
    pair["simulated"] = found
    result = {"replicas": 2, "profile": {"name": "cpu"}, "sessions": 1, "index": "embedded"}
    report = format_report(result | {"policies": {"pow2": pair}, "targets": {}})
    assert "errors 3" in report and "no reply within 300 s" in report


def test_a_run_on_a_slowed_clock_says_so_in_its_report() -> None:
    found = figures([Measured("chat", 1.5, 100, 40, 60)])
    pair = {"emulated": found | {"pulls": 0, "wall_s": 6.0, "devices": []}, "simulated": found}
    result = {"replicas": 32, "profile": {"name": "cpu"}, "sessions": 1, "index": "embedded"}
    result |= {"policies": {"baton": pair}, "targets": {}}
    assert "slower" not in format_report(result | {"slowdown": 1.0})
    assert "on a clock 4x slower" in format_report(result | {"slowdown": 4.0})


def test_the_report_plots_each_policys_ttfts_beside_the_simulators(tmp_path) -> None:
    records = [Measured("chat", t, 100, 40, 60) for t in (0.5, 1.5, 4.0)]
    failed = [Measured("chat", None, 100, 0, 100, error="no reply within 300 s")]
    emulated = figures(records) | {"records": [asdict(r) for r in records + failed]}
    policies = {
        "baton": {"emulated": emulated, "simulated": {"ttfts_s": [0.4, 1.2, 3.0]}},
        "pow2": {"emulated": emulated | {"records": []}, "simulated": {}},  # none answered
    }
    result = {"replicas": 32, "profile": {"name": "cpu"}, "slowdown": 4.0, "policies": policies}
    (path,) = emulated_plots(result, tmp_path)
    assert path.name == "emulated-32_ttft_cdf.png"
    assert_png(path)


# Prefix-affinity (Ray's PrefixCacheAffinityRouter) reads a request's text: token ids
# gave it an empty one, it raised ZeroDivisionError and the request waited for ever.
@pytest.mark.slow
@pytest.mark.parametrize("router", [RouterPolicy.BATON, RouterPolicy.PREFIX_AFFINITY])
def test_four_emulated_replicas_serve_through_the_gateway_and_router(
    router, tiny_model, serve_port
) -> None:
    config = BatonConfig(
        model=str(tiny_model("llama")),
        replicas=4,
        num_cpus_per_replica=0.01,
        engine=EngineConfig(**SETTINGS, emulated=FAST),
        router=router,
        heartbeat_s=0.2,
        hmac_key=secrets.token_hex(16),
    )
    app = "emulated"
    serve.run(build_app(config), name=app, route_prefix=f"/{app}")
    url = f"http://127.0.0.1:{serve_port}/{app}"
    try:
        wait_healthy(url)
        n_vocab = EmulatedModel(str(tiny_model("llama")), FAST).n_vocab
        cached = []
        for prompt in _turns(n_vocab):
            body = {"model": config.served_model_name, "prompt": list(prompt.tokens)}
            body |= {"max_tokens": 6, "ignore_eos": True, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            asyncio.run(wait_idle(app))  # the turn's checkpoints are saved (replay included)
            time.sleep(0.5)  # and reach the index
        assert cached[0] == 0 and all(c >= 150 for c in cached[1:]), cached
        stats = asyncio.run(replica_stats(app))
        assert len(stats) == 4 and {s["device"] for s in stats} == {"emulated:test"}
    finally:
        serve.delete(app)
