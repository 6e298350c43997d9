"""The Ray Serve config (`serve deploy`, KubeRay's `serveConfigV2`) that deploys a Baton config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from deploy.config import BatonConfig, to_serve_args


def serve_config(
    config: BatonConfig, *, app_name: str = "baton", import_path: str = "deploy.app:app_builder"
) -> dict[str, Any]:
    """A `ServeDeploySchema`-shaped dict: one application built by `import_path` from `config`."""
    return {
        "http_options": {"host": config.host, "port": config.port},
        "applications": [
            {
                "name": app_name,
                "route_prefix": "/",
                "import_path": import_path,
                "args": to_serve_args(config),
            }
        ],
    }


def write_serve_config(config: BatonConfig, path: str | Path) -> None:
    """Write `serve_config(config)` as YAML, readable by its owner only (it holds secrets)."""
    text = yaml.safe_dump(serve_config(config), sort_keys=False)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
