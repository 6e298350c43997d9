"""The `routing.*` settings: one object whose defaults are the runtime's, read from the
environment like any setting, reaching Baton's router and every replica's pull rule."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

from serve_build import deployments

from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.deploy.app import REPLICA_DEPLOYMENT, build_app
from baton_serve.deploy.config import load_config
from baton_serve.deploy.routing_settings import RoutingSettings
from baton_serve.replicas.shipping import ShipPolicy
from baton_serve.replicas.stream_limits import ReceiverBounds
from baton_serve.router.routing.request_router import BatonRouter


def test_the_defaults_are_the_runtimes() -> None:
    settings = RoutingSettings()
    assert settings.ship_cost(ShipCost.bandwidth_bytes_per_s) == ShipCost()
    assert settings.pull_deadline_s == ShipPolicy.deadline_s
    router = BatonRouter.initialize_state.__kwdefaults__
    for name in ("load_slack", "tokens_per_queued_request", "lookup_timeout_s", "max_view_age_s"):
        assert getattr(settings, name) == router[name], name


def test_reading_settings_loads_neither_ray_nor_redis() -> None:
    """The defaults come from light modules: `baton` reads its settings (and the device
    bench runs) without Ray or Redis."""
    code = "import sys, baton_serve.deploy.cli; print([m for m in ('ray', 'redis') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_settings_from_the_environment_reach_the_router_and_the_replicas(tiny_model) -> None:
    env = {
        "BATON_ROUTING__LOAD_SLACK": "0.5",
        "BATON_ROUTING__PULL_MIN_GAIN_TOKENS": "32",
        "BATON_ROUTING__PULL_DEADLINE_S": "5",
        "BATON_PULL_BANDWIDTH_GB_S": "25",
        "BATON_ROUTING__STREAM_MAX_RECEIVERS": "3",
    }
    config = load_config(env=env, overrides={"model": str(tiny_model("llama")), "replicas": 1})
    replica = deployments(build_app(config))[REPLICA_DEPLOYMENT]
    cost = ShipCost(min_gain_tokens=32, bandwidth_bytes_per_s=25e9)

    router_kwargs = replica._deployment_config.request_router_config.request_router_kwargs
    assert router_kwargs["load_slack"] == 0.5 and router_kwargs["ship_cost"] == asdict(cost)
    settings = replica.init_args[0]
    assert (settings.ship_cost, settings.pull_deadline_s) == (cost, 5.0)
    assert settings.stream_bounds == ReceiverBounds(max_streams=3)
