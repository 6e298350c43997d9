"""Replicas on one machine share its cores (`replicas/engine/core_share.py`): a prompt step
computes on the cores the other sharing replicas leave idle, and on its own only while they
compute."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from baton_serve.deploy.app import replica_actor_options
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.cpu_layout import share_cpus
from baton_serve.replicas.engine import core_share
from baton_serve.replicas.engine.core_share import IDLE_AFTER_S, CoreShare
from baton_serve.replicas.engine.llama_context import BatchEntry, ContextParams, LlamaContext
from baton_serve.replicas.engine.llama_model import LlamaModel

# A neighbour in a process of its own: it starts a step when told, ends it when told.
NEIGHBOUR = """
import sys
from pathlib import Path
from baton_serve.replicas.engine.core_share import CoreShare
share = CoreShare(int(sys.argv[2]), 8, Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
with share.step():
    print("computing", flush=True)
    sys.stdin.readline()
print("idle", flush=True)
sys.stdin.readline()
"""


class Neighbour:
    """A sharing replica in another process, driven line by line."""

    def __init__(self, directory: Path, threads: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", NEIGHBOUR, str(directory), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.expect("ready")

    def expect(self, line: str) -> None:
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == line

    def next(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        self.expect(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)


def _after_rescan(share: CoreShare) -> int:
    share._scanned_at = float("-inf")  # the directory is read again at most once a second
    return share.threads()


def test_a_replica_alone_computes_on_every_core(tmp_path: Path) -> None:
    share = CoreShare(1, 4, tmp_path)
    assert share.threads() == 4
    share.close()
    assert list(tmp_path.iterdir()) == []


def test_a_computing_neighbours_cores_are_left_to_it(tmp_path: Path) -> None:
    share = CoreShare(1, 4, tmp_path)
    one, two = Neighbour(tmp_path, 1), Neighbour(tmp_path, 2)
    try:
        assert _after_rescan(share) == 4
        one.next("computing")
        assert share.threads() == 3
        two.next("computing")
        assert share.threads() == 1  # never fewer than its own
        one.next("idle")
        time.sleep(IDLE_AFTER_S * 2)  # a neighbour that just ended a step may start the next
        assert share.threads() == 2
        two.next("idle")
        time.sleep(IDLE_AFTER_S * 2)
        assert share.threads() == 4
    finally:
        one.kill()
        two.kill()
        share.close()


def test_a_replica_that_died_in_a_step_gives_its_cores_back(tmp_path: Path) -> None:
    share = CoreShare(1, 2, tmp_path)
    neighbour = Neighbour(tmp_path, 1)
    try:
        neighbour.next("computing")
        assert _after_rescan(share) == 1
        neighbour.kill()
        assert _after_rescan(share) == 2
        assert [p.name for p in tmp_path.iterdir()] == [share._path.name]  # its file removed
    finally:
        share.close()


def test_prompt_steps_compute_on_the_idle_cores_of_the_machine(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch
) -> None:
    """Real llama.cpp: with `node_cores` a prompt step runs on every idle core, on the
    context's own threads while another sharing replica of this machine computes; a decode
    step always runs on its own. (Its own directory, so that no other process of the
    machine counts.)"""
    monkeypatch.setattr(core_share, "shared_directory", lambda: tmp_path)
    params = ContextParams(n_ctx_per_seq=256, n_seqs=2, n_batch=64, n_threads=1, node_cores=2)
    neighbour = CoreShare(1, 2, tmp_path)
    with LlamaModel(tiny_model("llama")) as model, LlamaContext(model, params) as context:
        token = model.any_token
        try:
            context.decode([BatchEntry(0, token, p, p == 7) for p in range(8)])
            assert context.threads == 2
            context.decode([BatchEntry(0, token, 8, True), BatchEntry(1, token, 0, True)])
            assert context.threads == 1  # a decode step: one token for each sequence
            with neighbour.step():
                _after_rescan(context._cores)
                context.decode([BatchEntry(1, token, p, p == 8) for p in range(1, 9)])
                assert context.threads == 1
            time.sleep(IDLE_AFTER_S * 2)
            context.decode([BatchEntry(1, token, p, p == 16) for p in range(9, 17)])
            assert context.threads == 2
        finally:
            neighbour.close()


def test_baton_serves_several_replicas_on_shared_cores() -> None:
    config = share_cpus(BatonConfig(replicas=2), 2)
    assert config.engine.node_cores == 2 and config.num_cpus_per_replica == 1
    env = replica_actor_options(config)["runtime_env"]["env_vars"]
    assert env == {"GOMP_SPINCOUNT": "3000"}  # see `deploy.app.replica_env`
    assert share_cpus(BatonConfig(replicas=1), 2).engine.node_cores is None
    assert "runtime_env" not in replica_actor_options(share_cpus(BatonConfig(replicas=1), 2))
    chosen = BatonConfig.model_validate({"replicas": 2, "engine": {"node_cores": 3}})
    assert share_cpus(chosen, 2) == chosen


def test_a_directory_that_goes_away_leaves_a_replica_its_own_cores(tmp_path: Path) -> None:
    directory = tmp_path / "cores"
    share = CoreShare(1, 2, directory)
    neighbour = Neighbour(directory, 1)
    try:
        neighbour.next("computing")
        assert _after_rescan(share) == 1
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()  # an operator's cleanup of /dev/shm: no neighbour can be seen
        assert _after_rescan(share) == 1
        with share.step():  # publishing still works (the mapping outlives the file)
            pass
    finally:
        neighbour.kill()
        share.close()


def test_without_a_usable_directory_a_context_computes_on_its_own_threads(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch, caplog
) -> None:
    """A real fault: the shared directory's parent is a file, so it cannot be made."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setattr(core_share, "shared_directory", lambda: blocker / "cores")
    params = ContextParams(n_ctx_per_seq=256, n_seqs=1, n_batch=64, n_threads=1, node_cores=2)
    with LlamaModel(tiny_model("llama")) as model, LlamaContext(model, params) as context:
        context.decode([BatchEntry(0, model.any_token, p, p == 7) for p in range(8)])
        assert context.threads == 1
    assert "not sharing the machine's idle cores" in caplog.text


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_prompt_on_borrowed_cores_computes_what_one_thread_does(
    tiny_model: Callable[[str], Path], arch: str
) -> None:
    """Sharing keeps states exact: a prompt and the decode steps after it give the same
    logits and the same state on one thread and on two, so a state built on borrowed cores
    equals one built elsewhere (`docs/engine.md`, bit-exact reuse)."""
    results = []
    with LlamaModel(tiny_model(arch)) as model:
        tokens = [(7 * p + 3) % model.n_vocab for p in range(40)]
        for threads in (1, 2):
            params = ContextParams(n_ctx_per_seq=256, n_seqs=1, n_batch=64, n_threads=threads)
            with LlamaContext(model, params) as context:
                rows = context.decode_rows(
                    [BatchEntry(0, t, p, p == 31) for p, t in enumerate(tokens[:32])]
                )
                logits = [*rows.values()]
                for p in range(32, 40):
                    logits += context.decode_rows([BatchEntry(0, tokens[p], p, True)]).values()
                results.append((np.concatenate(logits), bytes(context.save_state(0))))
    (one_logits, one_state), (two_logits, two_state) = results
    assert np.array_equal(one_logits, two_logits)
    assert one_state == two_state
