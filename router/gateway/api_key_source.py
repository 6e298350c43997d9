"""How API keys reach a gateway replica: as the cluster key reaches a replica, from a file or
the gateway's own environment, never inside Serve's deployment arguments (Serve pickles those
into Ray's GCS, and its fault-tolerance tables into Redis, and shows them in its status)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

API_KEYS_ENV = "BATON_API_KEYS"
API_KEYS_FILE_ENV = "BATON_API_KEYS_FILE"


class APIKeyError(ValueError):
    """Keys are required but none could be read; the message says where they were looked for."""


def split_api_keys(text: str) -> tuple[str, ...]:
    """Keys separated by commas or newlines (a mounted Secret may hold one a line)."""
    return tuple(key.strip() for key in text.replace("\n", ",").split(",") if key.strip())


@dataclass(frozen=True)
class APIKeySource:
    """Where a gateway replica reads its API keys (what travels in the deployment's
    arguments instead of the keys)."""

    required: bool  # keys are configured: a gateway that finds none fails rather than open
    file: str | None = None  # else the file BATON_API_KEYS_FILE names, else BATON_API_KEYS

    def read(self, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """The keys, or () when none are required."""
        if not self.required:
            return ()
        env = os.environ if env is None else env
        key_file = self.file or env.get(API_KEYS_FILE_ENV)
        if key_file:
            try:
                keys = split_api_keys(Path(key_file).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or exc
                raise APIKeyError(f"cannot read the API keys file {key_file}: {reason}") from None
            where = f"the API keys file {key_file}"
        else:
            keys, where = split_api_keys(env.get(API_KEYS_ENV, "")), API_KEYS_ENV
        if not keys:
            raise APIKeyError(
                f"API keys are required but {where} holds none: set {API_KEYS_ENV} (comma-"
                f"separated) or {API_KEYS_FILE_ENV} (a file holding them) on every Ray node "
                "that runs a gateway"
            )
        return keys
