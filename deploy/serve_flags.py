"""The `baton serve` flags that set configuration fields: each names its field, and its help
is the field's own description, so the flags, the docs and the config cannot disagree."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from baton_serve.deploy.config import BatonConfig

# Defaults computed where the setting is used, which the docs describe instead of showing.
COMPUTED_DEFAULTS = {
    "engine.n_threads": "num_cpus_per_replica",
    "num_cpus_per_replica": "`1`; `baton serve`'s local cluster: cores / replicas",
    "engine.node_cores": "unset; `baton serve`'s local cluster of several replicas: its cores",
}
_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclass(frozen=True)
class SettingFlag:
    """One flag: the setting it sets (a dotted path into `BatonConfig`) and how it parses."""

    flag: str
    setting: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = None  # None: the field's own int, float or str
    read: Callable[[str], Any] | None = None  # turns the parsed value into the setting's
    repeatable: bool = False
    help_prefix: str = ""  # what the flag's value is, where it is not the setting's value
    help_suffix: str = ""


def setting_field(path: str) -> FieldInfo:
    """The pydantic field of a dotted setting path such as `engine.n_ctx`."""
    model: type[BaseModel] = BatonConfig
    *parents, name = path.split(".")
    for parent in parents:
        annotation = model.model_fields[parent].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel), path
        model = annotation
    return model.model_fields[name]


def env_variable(path: str) -> str:
    """The environment variable of a setting: `engine.n_ctx` is `BATON_ENGINE__N_CTX`."""
    return "BATON_" + "__".join(part.upper() for part in path.split("."))


def default_text(path: str, field: FieldInfo) -> str:
    """A setting's default as the docs show it (Markdown)."""
    if path in COMPUTED_DEFAULTS:
        return COMPUTED_DEFAULTS[path]
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            title = type(value).__name__
            return f"[`{title}`](#{title.lower()})"
    else:
        value = field.default
    assert value is not PydanticUndefined, f"{path} has no default"
    if value is None or value in ({}, ()):
        return "unset" if value is None else "none"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and path.endswith("_bytes"):
        for unit, size in _BINARY_UNITS:
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """`1073741824`, `512M`, `20G` (binary multiples; a trailing `i`/`B` is allowed)."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    number, suffix = (value[:-1], value[-1]) if value[-1:].isalpha() else (value, "")
    try:
        return int(float(number) * _SIZE_SUFFIXES[suffix])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 1073741824, 512M or 20G, got {text!r}"
        ) from None


def read_chat_template(path: str) -> str:
    """The text of a chat template file."""
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc.strerror}") from exc


SERVE_FLAGS = (
    SettingFlag("--model", "model"),
    SettingFlag("--mmproj", "mmproj"),
    SettingFlag("--model-name", "model_name"),
    SettingFlag("--replicas", "replicas"),
    SettingFlag("--gpus-per-replica", "num_gpus_per_replica"),
    SettingFlag("--cpus-per-replica", "num_cpus_per_replica"),
    SettingFlag("--n-gpu-layers", "engine.n_gpu_layers"),
    SettingFlag("--n-ctx", "engine.n_ctx"),
    SettingFlag(
        "--chat-template",
        "engine.chat_template",
        metavar="FILE",
        read=read_chat_template,
        help_prefix="a file holding",
    ),
    SettingFlag("--slots", "engine.n_slots"),
    SettingFlag("--checkpoint-dir", "engine.checkpoint_dir", metavar="DIR"),
    SettingFlag(
        "--disk-budget",
        "engine.disk_budget_bytes",
        metavar="BYTES",
        type=byte_size,
        help_suffix="suffixes K, M, G, T: binary",
    ),
    SettingFlag("--handoff-s", "handoff_s", metavar="SECONDS"),
    SettingFlag("--pull-bandwidth-gb-s", "pull_bandwidth_gb_s", metavar="GB_S"),
    SettingFlag("--index", "index"),
    SettingFlag("--router", "router"),
    SettingFlag("--api-key", "api_keys", repeatable=True, help_suffix="repeatable"),
    SettingFlag("--host", "host"),
    SettingFlag("--port", "port"),
    SettingFlag("--metrics-port", "metrics_port"),
)


def flag_of(path: str) -> SettingFlag | None:
    """The `baton serve` flag that sets a setting, if one does."""
    return next((flag for flag in SERVE_FLAGS if flag.setting == path), None)


def flag_help(flag: SettingFlag) -> str:
    """The field's description, with the flag's own prefix and suffix, the setting's default
    and its environment variable; `%` is escaped for argparse."""
    field = setting_field(flag.setting)
    text = field.description or ""
    if flag.help_prefix:
        text = f"{flag.help_prefix} {text}"
    notes = [flag.help_suffix] if flag.help_suffix else []
    notes.append(f"default: {default_text(flag.setting, field).replace('`', '')}")
    notes.append(env_variable(flag.setting))
    return f"{text} ({'; '.join(notes)})".replace("%", "%%")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Add every setting flag, each storing into a `dest` named after its setting path."""
    for flag in SERVE_FLAGS:
        field = setting_field(flag.setting)
        options: dict[str, Any] = {"dest": _dest(flag), "help": flag_help(flag)}
        choices = _enum_of(field.annotation)
        if choices is not None:
            options["choices"] = [member.value for member in choices]
        else:
            options["metavar"] = flag.metavar or flag.flag.lstrip("-").upper().replace("-", "_")
            if flag.read is None:
                options["type"] = flag.type or _scalar_type(field.annotation)
        if flag.repeatable:
            options["action"] = "append"
        parser.add_argument(flag.flag, **options)


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags gave, nested (`{"engine": {"n_ctx": 2048}}`); None where a flag
    was not given (`load_config` ignores those)."""
    overrides: dict[str, Any] = {}
    for flag in SERVE_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None and flag.read is not None:
            value = flag.read(value)
        *parents, name = flag.setting.split(".")
        target = overrides
        for parent in parents:
            target = target.setdefault(parent, {})
        target[name] = value
    return overrides


def _dest(flag: SettingFlag) -> str:
    return flag.setting.replace(".", "__")


def _scalar_type(annotation: Any) -> Callable[[str], Any]:
    """int, float or str: the one an `X` or `X | None` field takes from a command line."""
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    for kind in (int, float):
        if kind in members:
            return kind
    return str


def _enum_of(annotation: Any) -> type[Enum] | None:
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return next((m for m in members if isinstance(m, type) and issubclass(m, Enum)), None)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
