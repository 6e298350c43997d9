"""The `baton` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

from baton_serve.cache_store.telemetry.logs import FORMATS, configure_logging
from baton_serve.deploy.config import load_config
from baton_serve.deploy.serve_flags import add_serve_flags, overrides_from
from baton_serve.replicas.engine.ggml_backends import BackendUnavailable
from baton_serve.replicas.models.default_model import DefaultModelMissing
from baton_serve.replicas.models.model_check import ModelCheckFailed
from baton_serve.replicas.models.model_shapes import REAL_SHAPES
from baton_serve.replicas.models.model_source import resolve_model

COMMANDS_ENTRY_POINTS = "baton_serve.commands"
DISTRIBUTION = "baton-serve"
MODEL_HELP = (
    "GGUF path, hf://ORG/REPO/FILE.gguf[@REV] (downloaded once into the cache), or "
    "tiny:ARCH (default: SmolLM2-135M-Instruct)"
)
# Failures a user fixes (a setting, a file, a missing package): their message says how.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    DefaultModelMissing,
    ModelCheckFailed,
    BackendUnavailable,
)


def _plugin_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Commands other rooms register (`baton bench` from loadtests), found by entry point
    so that this module imports nothing above it."""
    return [ep.load() for ep in entry_points(group=COMMANDS_ENTRY_POINTS)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Whatever level the root logger ends up at (Ray may reconfigure it), the benchmarks'
    # HTTP client must not log each of their requests.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"baton: error: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, USER_ERRORS) else 1


def _one_line(exc: Exception) -> str:
    """The cause in one line: a user error's own message; anything else with its type and
    the way to see the traceback."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, USER_ERRORS):
        return message
    return f"{type(exc).__name__}: {message} (run with --debug for the traceback)"


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"baton {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected failure"
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    make = commands.add_parser("make-model", help="write a tiny random-weight GGUF test model")
    make.add_argument("--arch", required=True, help="llama, qwen35, lfm2, granitehybrid or mamba2")
    make.add_argument("--out", required=True, help="output .gguf file")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--layers", type=int, default=2)
    make.add_argument("--embd", type=int, default=64, help="embedding size (multiple of 32)")
    make.add_argument(
        "--shape",
        choices=sorted(REAL_SHAPES),
        help="a real model's widths instead of --embd's (llama, qwen35; for GPU benches)",
    )
    make.add_argument(
        "--mmproj",
        metavar="PATH",
        help="also write a matching projector, images and audio (qwen35, llama)",
    )
    make.add_argument(
        "--tokenizer-from",
        metavar="GGUF",
        help="take the tokenizer from this GGUF file (default: the SmolLM2 model's)",
    )
    variant = make.add_argument_group("metadata and structure variants")
    variant.add_argument("--no-bos", action="store_true", help="no BOS token id")
    variant.add_argument("--no-eos", action="store_true", help="no EOS token id")
    variant.add_argument(
        "--special-ids-out-of-vocab", action="store_true", help="BOS/EOS ids past the vocabulary"
    )
    variant.add_argument("--no-chat-template", action="store_true", help="no chat template")
    variant.add_argument(
        "--extra-eog", type=int, metavar="ID", help="one more end-of-generation token id"
    )
    variant.add_argument("--ctx-train", type=int, default=8192, help="training context length")
    variant.add_argument(
        "--vocab",
        choices=("smollm2", "test", "none"),
        default="smollm2",
        help="SmolLM2's tokenizer, llama.cpp's test vocabulary, or none (token ids only)",
    )
    variant.add_argument("--moe", action="store_true", help="mixture-of-experts FFN (llama)")
    variant.add_argument(
        "--sliding-window", type=int, default=0, metavar="N", help="attention window (lfm2)"
    )
    variant.add_argument("--weights", choices=("f16", "q8_0", "q4_0"), default="f16")
    make.set_defaults(run=_make_model)

    serve = commands.add_parser(
        "serve", help="serve the OpenAI-compatible API from a local Ray cluster"
    )
    serve.add_argument(
        "--config", help="YAML file of settings (BATON_* variables and flags override it)"
    )
    add_serve_flags(serve)
    serve.add_argument(
        "--log-format", choices=FORMATS, help="log lines as text or JSON (BATON_LOG_FORMAT)"
    )
    serve.add_argument("--address", help="join this Ray cluster instead of starting one")
    serve.set_defaults(run=_serve)

    yaml_config = commands.add_parser(
        "serve-config", help="write the Ray Serve config YAML (serve run / serve deploy)"
    )
    yaml_config.add_argument("--config", help="YAML file of Baton settings")
    yaml_config.add_argument("--out", default="-", help="output file (default: stdout)")
    yaml_config.set_defaults(run=_serve_config)

    demo = commands.add_parser(
        "demo", help="chat with the model on a local engine, showing cache reuse"
    )
    demo.add_argument("--model", help=MODEL_HELP)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.set_defaults(run=_demo)

    for add_commands in _plugin_commands():
        add_commands(commands)

    return parser


def _serve(args: argparse.Namespace) -> int:
    from baton_serve.deploy.server import serve_until_interrupted
    from baton_serve.deploy.startup import AppStartFailed

    overrides = overrides_from(args)
    config = load_config(args.config, overrides=overrides)
    if args.log_format:  # the Ray workers started from here inherit the environment
        os.environ["BATON_LOG_FORMAT"] = args.log_format
    configure_logging()
    try:
        serve_until_interrupted(config, address=args.address)
    except AppStartFailed as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve_config(args: argparse.Namespace) -> int:
    from baton_serve.deploy.serve_config import serve_config, write_serve_config

    config = load_config(args.config)
    if args.out == "-":
        import yaml

        print(yaml.safe_dump(serve_config(config), sort_keys=False), end="")
    else:
        write_serve_config(config, args.out)
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from baton_serve.replicas.models.tiny_model import ModelVariant, write_tiny_model
    from baton_serve.replicas.models.tiny_projector import PROJECTOR_TYPES, write_tiny_projector

    if args.mmproj and args.arch not in PROJECTOR_TYPES:
        supported = ", ".join(PROJECTOR_TYPES)
        raise ValueError(f"--mmproj: no projector for {args.arch}; supported: {supported}")
    variant = ModelVariant(
        bos=not args.no_bos,
        eos=not args.no_eos,
        special_ids_out_of_vocab=args.special_ids_out_of_vocab,
        chat_template=not args.no_chat_template,
        extra_eog=args.extra_eog,
        ctx_train=args.ctx_train,
        vocab=args.vocab,
        moe=args.moe,
        sliding_window=args.sliding_window,
        weights=args.weights,
    )
    shape = REAL_SHAPES[args.shape] if args.shape else None
    path = write_tiny_model(
        args.arch,
        args.out,
        seed=args.seed,
        n_layers=args.layers,
        n_embd=args.embd,
        tokenizer_from=args.tokenizer_from,
        variant=variant,
        shape=shape,
    )
    print(path)
    if args.mmproj:
        mmproj = Path(args.mmproj)
        n_embd = shape.n_embd if shape else args.embd
        print(write_tiny_projector(mmproj, arch=args.arch, n_embd_text=n_embd, seed=args.seed))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from baton_serve.replicas.models.demo import run_demo

    run_demo(resolve_model(args.model), max_tokens=args.max_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
