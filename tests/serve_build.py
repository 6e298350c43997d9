"""What Ray Serve keeps of a built Baton app, for the tests that secrets stay out of it:
its deployments by name, and the bytes Serve stores of each."""

from __future__ import annotations

import os
from typing import Any

import pytest
from ray import cloudpickle

from baton_serve.deploy.app import APP_NAME


def clear_baton_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset every `BATON_*` variable but the cache directory, so none reaches a config."""
    for name in [n for n in os.environ if n.startswith("BATON_") and n != "BATON_CACHE_DIR"]:
        monkeypatch.delenv(name)


def deployments(app: Any) -> dict[str, Any]:
    """The app's deployments as Serve builds them, by name."""
    from ray.serve._private.build_app import build_app as serve_build_app

    return {d.name: d for d in serve_build_app(app, name=APP_NAME).deployments}


def kept_by_serve(deployment: Any) -> bytes:
    """What Serve stores and shows of a deployment: its arguments, options and config."""
    return cloudpickle.dumps(
        (
            deployment.init_args,
            deployment.init_kwargs,
            deployment.ray_actor_options,
            deployment._deployment_config,
        )
    )
