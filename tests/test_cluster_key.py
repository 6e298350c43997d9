"""The cluster key reaches replicas from a file or their environment, never inside Serve's
deployment arguments (Serve stores those with the application and shows them); a disk tier
needs a fixed key. The apps are built as Serve's controller builds them, without a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from serve_build import clear_baton_variables, deployments, kept_by_serve

from baton_serve.cache_store.checkpoints.cluster_key import ClusterKeyError, read_cluster_key
from baton_serve.deploy import app as app_module
from baton_serve.deploy.app import REPLICA_DEPLOYMENT, build_app, check_cluster_key
from baton_serve.deploy.config import BatonConfig, ConfigError, load_config
from baton_serve.deploy.serve_config import serve_config
from baton_serve.replicas.engine.engine_config import EngineConfig

KEY = "cluster-key-do-not-leak-0123456789"


@pytest.fixture(autouse=True)
def no_baton_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_baton_variables(monkeypatch)


def assert_no_key_material(built: dict[str, Any], key: str) -> None:
    """Nothing Serve keeps of any deployment (its arguments, options, config) holds the key,
    raw or hex-encoded as the replicas' arguments once carried it."""
    for deployment in built.values():
        kept = kept_by_serve(deployment)
        assert key.encode() not in kept and key.encode().hex().encode() not in kept


def test_a_local_app_hands_replicas_a_private_key_file_not_the_key(tiny_model) -> None:
    config = BatonConfig(model=str(tiny_model("llama")), replicas=1, hmac_key=KEY)
    built = deployments(build_app(config))
    assert_no_key_material(built, KEY)
    key_file = Path(built[REPLICA_DEPLOYMENT].init_args[0].hmac_key_file)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    assert read_cluster_key(str(key_file), env={}) == KEY.encode()
    assert KEY not in yaml.safe_dump(serve_config(config))  # `baton serve-config` neither

    generated = deployments(build_app(BatonConfig(model=str(tiny_model("llama")), replicas=1)))
    key = read_cluster_key(generated[REPLICA_DEPLOYMENT].init_args[0].hmac_key_file, env={})
    assert len(key) == 64
    assert_no_key_material(generated, key.decode())


def test_with_the_key_in_the_environment_replicas_read_their_own(
    tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_HMAC_KEY", KEY)
    config = load_config(overrides={"model": str(tiny_model("llama")), "replicas": 1})
    built = deployments(build_app(config))
    assert built[REPLICA_DEPLOYMENT].init_args[0].hmac_key_file is None
    assert_no_key_material(built, KEY)
    assert read_cluster_key() == KEY.encode()


def test_app_builder_takes_the_key_from_the_nodes_never_from_args(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = {"model": str(tiny_model("llama")), "replicas": 1}
    with pytest.raises(ConfigError, match="must not hold hmac_key") as in_args:
        app_module.app_builder({**args, "hmac_key": KEY})
    assert KEY not in str(in_args.value)
    with pytest.raises(ConfigError, match="no cluster key: set BATON_HMAC_KEY"):
        app_module.app_builder(args)
    mounted = tmp_path / "hmac-key"
    mounted.write_text(KEY + "\n")  # as a Secret mounted as a file may hold it
    monkeypatch.setenv("BATON_HMAC_KEY_FILE", str(mounted))
    built = deployments(app_module.app_builder(args))
    assert built[REPLICA_DEPLOYMENT].init_args[0].hmac_key_file == str(mounted)
    assert_no_key_material(built, KEY)
    assert read_cluster_key(str(mounted)) == KEY.encode()


def test_reading_the_key_names_what_is_missing(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("too-short")
    with pytest.raises(ClusterKeyError, match="no cluster key: set BATON_HMAC_KEY"):
        read_cluster_key(env={})
    with pytest.raises(ClusterKeyError, match="cannot read the cluster key file .*missing"):
        read_cluster_key(str(tmp_path / "missing"), env={"BATON_HMAC_KEY": KEY})
    with pytest.raises(ClusterKeyError, match="holds 9 characters, fewer than 16"):
        read_cluster_key(env={"BATON_HMAC_KEY_FILE": str(short)})
    assert read_cluster_key(env={"BATON_HMAC_KEY": f" {KEY}\n"}) == KEY.encode()


def test_a_disk_tier_without_a_fixed_key_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    disk = EngineConfig(checkpoint_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="needs a fixed cluster key: set BATON_HMAC_KEY"):
        check_cluster_key(BatonConfig(engine=disk))
    check_cluster_key(BatonConfig(engine=disk, hmac_key=KEY))
    check_cluster_key(BatonConfig(engine=disk, hmac_key_file=str(tmp_path / "key")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    done = subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--model", "tiny:llama"]
        + ["--checkpoint-dir", str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        env={**env, "BATON_CACHE_DIR": str(tmp_path / "cache")},
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(
        "baton: error: engine.checkpoint_dir (--checkpoint-dir) needs a fixed cluster key"
    ), done.stderr
    assert "BATON_HMAC_KEY_FILE" in done.stderr
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was made
