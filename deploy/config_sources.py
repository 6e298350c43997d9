"""Where settings come from before they are validated: a YAML file, `BATON_*` environment
variables and command-line overrides, merged as nested mappings (`deploy.config.load_config`
layers them; docs/configuration.md says why this is not pydantic-settings)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from baton_serve.router.gateway.api_key_source import split_api_keys

ENV_PREFIX = "BATON_"
ENV_NESTING = "__"


class ConfigError(ValueError):
    """An invalid configuration; the message lists every problem as `field.path: message`."""


def read_yaml(path: Path) -> dict[str, Any]:
    """The settings of a YAML file; `ConfigError` names a file that cannot be read or is no
    mapping, without quoting its text (it may hold secrets)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Built from the parts, not str(exc), whose snippet of the line could hold a secret.
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"invalid YAML in config file {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of settings, not a {type(data).__name__}"
        )
    return data


def from_env(env: Mapping[str, str], fields: Collection[str]) -> dict[str, Any]:
    """Settings from `BATON_<FIELD>[__<SUBFIELD>]` variables whose FIELD is in `fields`; other
    BATON_* names are ignored (e.g. BATON_CACHE_DIR). `BATON_API_KEYS` is a comma-separated
    list."""
    data: dict[str, Any] = {}
    for name, value in sorted(env.items()):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split(ENV_NESTING)
        if path[0] not in fields:
            continue
        setting: Any = value
        if path == ["api_keys"]:
            setting = list(split_api_keys(value))
        for key in reversed(path):
            setting = {key: setting}
        data = merge(data, setting)
    return data


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` updated by `override`, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def without_none(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` without its None entries, at every depth (flags not given)."""
    return {
        key: without_none(value) if isinstance(value, Mapping) else value
        for key, value in values.items()
        if value is not None
    }
