"""How the cluster key (the HMAC key that signs state blobs) reaches a replica.

Never through Serve's deployment arguments, which Serve stores with the application and
shows in its status: a replica reads the key from a file (a Kubernetes Secret mounted on
every node, or the private file `baton serve` writes for a local cluster) or from its own
environment.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

KEY_ENV = "BATON_HMAC_KEY"
KEY_FILE_ENV = "BATON_HMAC_KEY_FILE"
MIN_KEY_CHARS = 16


class ClusterKeyError(ValueError):
    """No usable cluster key; the message says where one was looked for and how to set it."""


def read_cluster_key(key_file: str | None = None, env: Mapping[str, str] | None = None) -> bytes:
    """The cluster key: the contents of `key_file` if given, else of the file named by
    `BATON_HMAC_KEY_FILE`, else `BATON_HMAC_KEY` (surrounding whitespace removed)."""
    env = os.environ if env is None else env
    key_file = key_file or env.get(KEY_FILE_ENV)
    if key_file:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterKeyError(
                f"cannot read the cluster key file {key_file}: {getattr(exc, 'strerror', exc)}; "
                f"on a cluster of several machines, give every node {KEY_ENV} or {KEY_FILE_ENV}"
            ) from None
        where = f"the cluster key file {key_file}"
    elif env.get(KEY_ENV):
        key, where = env[KEY_ENV].strip(), KEY_ENV
    else:
        raise ClusterKeyError(
            f"no cluster key: set {KEY_ENV} (the key) or {KEY_FILE_ENV} (a file holding it) "
            "in the environment of every Ray node"
        )
    if len(key) < MIN_KEY_CHARS:
        raise ClusterKeyError(f"{where} holds {len(key)} characters, fewer than {MIN_KEY_CHARS}")
    return key.encode()


def write_private_key_file(key: str, name: str = "hmac-key") -> Path:
    """Write `key` to a new file `name`, mode 0600, in a new directory, mode 0700, that is
    deleted when this process exits: for replicas (or gateways) on this machine (a local
    cluster)."""
    folder = Path(tempfile.mkdtemp(prefix="baton-key-"))  # 0700
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(key)
    return path
