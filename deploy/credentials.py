"""Who may call the API and who may sign states: the credentials `BatonConfig` inherits.

Neither travels in Serve's deployment arguments (Serve stores and shows them): replicas read
the cluster key (`cache_store.checkpoints.cluster_key`) and gateways the API keys
(`router.gateway.api_key_source`) from their own environment or files.
"""

from __future__ import annotations

import secrets

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from typing_extensions import Self

from baton_serve.router.gateway.api_key_source import (
    API_KEYS_ENV,
    API_KEYS_FILE_ENV,
    split_api_keys,
)

MIN_HMAC_KEY_CHARS = 16


class Credentials(BaseModel):
    """The API keys and the cluster key, each given directly or as a file (not both)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_keys: tuple[SecretStr, ...] = Field(
        default=(),
        description="accepted API keys: when set, every path but /health needs "
        "Authorization: Bearer KEY (deny-by-default); empty: no auth; BATON_API_KEYS is a "
        "comma-separated list. Gateways read them from their environment or api_keys_file, "
        "never from Serve's arguments",
    )
    api_keys_file: str | None = Field(
        default=None,
        min_length=1,
        description="a file holding the API keys instead (comma- or newline-separated; a "
        "mounted Secret): every node that runs a gateway must have it at this path; a gateway "
        "that finds no key there fails to start",
    )
    hmac_key: SecretStr | None = Field(
        default=None,
        description="the cluster key (at least 16 characters) that signs state blobs between "
        "replicas and on disk; replicas read it from their environment or hmac_key_file, never "
        "from Serve's arguments; unset: generated per serve, so a disk tier "
        "(engine.checkpoint_dir) needs a fixed one",
    )
    hmac_key_file: str | None = Field(
        default=None,
        min_length=1,
        description="a file holding the cluster key instead (a mounted Secret): every node "
        "must have it at this path",
    )

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        if any(not key.get_secret_value() for key in value):
            raise ValueError("an API key must not be empty")
        # Keys travel comma- or newline-separated (BATON_API_KEYS, a keys file).
        if any(split_api_keys(text := key.get_secret_value()) != (text,) for key in value):
            raise ValueError(
                "an API key must not hold a comma or a line break, or begin or end with a space"
            )
        return value

    @field_validator("hmac_key")
    @classmethod
    def _check_hmac_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_HMAC_KEY_CHARS:
            raise ValueError(f"must be at least {MIN_HMAC_KEY_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _check_one_source(self) -> Self:
        if self.hmac_key is not None and self.hmac_key_file is not None:
            raise ValueError("set hmac_key (BATON_HMAC_KEY) or hmac_key_file, not both")
        if self.api_keys and self.api_keys_file is not None:
            raise ValueError(
                f"set api_keys ({API_KEYS_ENV}) or api_keys_file ({API_KEYS_FILE_ENV}), not both"
            )
        return self

    def with_hmac_key(self) -> Self:
        """This config, with a random 32-byte (hex) `hmac_key` if none is set."""
        if self.hmac_key is not None:
            return self
        return self.model_copy(update={"hmac_key": SecretStr(secrets.token_hex(32))})
