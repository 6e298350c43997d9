"""The configuration reference in docs/configuration.md and `baton serve --help` are made from
the config fields' descriptions: every field has one, the docs are current, and each flag
sets the setting whose description it shows."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from baton_serve.deploy import cli, config_reference
from baton_serve.deploy.config import BatonConfig, load_config
from baton_serve.deploy.routing_settings import RoutingSettings
from baton_serve.deploy.serve_flags import SERVE_FLAGS, overrides_from, setting_field
from baton_serve.replicas.engine.engine_config import EngineConfig

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"


def test_every_field_is_described() -> None:
    for model in (BatonConfig, EngineConfig, RoutingSettings):
        for name, field in model.model_fields.items():
            assert field.description and len(field.description) > 10, f"{model.__name__}.{name}"


def test_the_reference_in_the_docs_is_current() -> None:
    """Regenerate with `python -m baton_serve.deploy.config_reference`."""
    text = DOC.read_text(encoding="utf-8")
    assert text == config_reference.with_reference(text)
    nested = [f"engine.{n}" for n in EngineConfig.model_fields]
    nested += [f"routing.{n}" for n in RoutingSettings.model_fields]
    for path in [*BatonConfig.model_fields, *nested]:
        assert f"| `{path}` |" in text


def test_with_reference_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="config-reference"):
        config_reference.with_reference("# no markers\n")


def serve_help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    return "".join(out.getvalue().split())  # argparse wraps lines, at hyphens too


def test_serve_help_shows_the_field_descriptions() -> None:
    text = serve_help()
    for flag in SERVE_FLAGS:
        description = "".join((setting_field(flag.setting).description or "").split())
        assert flag.flag in text and description in text, flag.flag


def parse_serve(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(["serve", *argv])


def test_flags_set_their_settings(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    args = parse_serve(
        "--n-ctx=2048",
        "--slots=2",
        "--disk-budget=1G",
        "--api-key=a",
        "--api-key=b",
        "--router=pow2",
        "--handoff-s=0",
        "--chat-template",
        str(template),
        "--gpus-per-replica=0.5",
    )
    config = load_config(env={}, overrides=overrides_from(args))
    assert (config.engine.n_ctx, config.engine.n_slots) == (2048, 2)
    assert config.engine.disk_budget_bytes == 1 << 30
    assert [key.get_secret_value() for key in config.api_keys] == ["a", "b"]
    assert config.router.value == "pow2" and config.handoff_s == 0
    assert config.engine.chat_template == "{{ messages }}"
    assert config.num_gpus_per_replica == 0.5
    # Flags not given leave the lower layers alone.
    assert load_config(env={}, overrides=overrides_from(parse_serve())) == BatonConfig()


def test_flag_values_are_checked_by_argparse_and_by_the_config() -> None:
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse_serve("--disk-budget=lots")
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse_serve("--router=fastest")
    with pytest.raises(ValueError, match="cannot read the chat template"):
        overrides_from(parse_serve("--chat-template=/no/such/file"))
