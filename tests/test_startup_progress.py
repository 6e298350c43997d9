"""`baton serve`'s start-up: replica stages shown as they change, and a replica that fails to
start named with its own error line (real Ray Serve)."""

from __future__ import annotations

import secrets

import pytest
from ray import serve

from baton_serve.deploy.app import APP_NAME, build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.startup import AppStartFailed, deploy_with_progress
from baton_serve.replicas.engine.engine_config import EngineConfig


def test_replica_stages_are_shown_until_ready(serve_port, tiny_model, tmp_path) -> None:
    config = BatonConfig(
        model=str(tiny_model("llama")),
        replicas=2,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=256, n_slots=1, n_threads=1),
        hmac_key=secrets.token_hex(16),
    )
    app = build_app(config, startup_dir=str(tmp_path))
    shown: list[str] = []
    try:
        deploy_with_progress(app, name=APP_NAME, stages_dir=str(tmp_path), show=shown.append)
    finally:
        serve.delete(APP_NAME)
    ready = [line for line in shown if ": ready (" in line]
    assert len(ready) == 2, shown


@serve.deployment(name="Replica")
class _FailsAtStart:
    """Stands in for a replica whose engine cannot start (a fault injected here: a real
    one, e.g. llama.cpp running out of memory, cannot be caused on demand)."""

    def __init__(self) -> None:
        raise RuntimeError("llama.cpp could not create a context (out of memory?)")


def test_a_replica_that_fails_to_start_is_named_with_its_error(serve_port) -> None:
    with pytest.raises(AppStartFailed) as caught:
        deploy_with_progress(_FailsAtStart.bind(), name="failing", stages_dir=None)
    serve.delete("failing")
    message = str(caught.value)
    assert "Replica deployment failed to start" in message
    assert message.endswith("RuntimeError: llama.cpp could not create a context (out of memory?)")
