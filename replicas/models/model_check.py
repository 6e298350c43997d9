"""Load a model once in a child process before serving it.

A GGUF file that llama.cpp refuses, or whose load or first decode kills the process (an
unsupported architecture, a corrupt tensor, an instruction the CPU cannot run), or an engine
config whose model, caches and buffers cannot fit the device (`device_memory.check_fits`),
must fail `baton serve` at start with its cause — not send every replica into a crash loop.
`check_model` runs `python -m baton_serve.replicas.models.model_check PATH` and reports what the child saw.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.ggml_backends import exit_description

CHECK_TIMEOUT_S = 300.0


class ModelCheckFailed(RuntimeError):
    """The model cannot be served on this machine; the message says why."""


@dataclass(frozen=True)
class ModelReport:
    """What the child learnt about the model and the machine."""

    kind: str
    n_vocab: int
    n_ctx_train: int
    has_bos: bool
    has_eos: bool
    has_chat_template: bool
    has_text: bool
    cpu_backend: str
    cpu_repack: bool
    device: str

    def summary(self) -> str:
        specials = ", ".join(
            name
            for name, present in (
                ("no BOS", not self.has_bos),
                ("no EOS", not self.has_eos),
                ("no chat template", not self.has_chat_template),
                ("token ids only", not self.has_text),
            )
            if present
        )
        return (
            f"{self.kind} model, {self.n_vocab} tokens, trained context {self.n_ctx_train}"
            f"{'; ' + specials if specials else ''}; llama.cpp CPU backend {self.cpu_backend}"
            f" (weight repacking {'on' if self.cpu_repack else 'off'}); device {self.device}"
        )


def check_model(
    path: str | Path,
    *,
    n_gpu_layers: int = 0,
    cpu_repack: bool | None = None,
    env: Mapping[str, str] | None = None,
    engine: EngineConfig | None = None,
    gpu_share: float = 1.0,
) -> ModelReport:
    """Load `path` and decode a few tokens in a child process (with `env` added to its
    environment, as a replica's); with `engine`, first check its config fits the device
    (`gpu_share` of it, a replica's); raise `ModelCheckFailed`."""
    command = [sys.executable, "-m", "baton_serve.replicas.models.model_check", str(path)]
    command += ["--n-gpu-layers", str(n_gpu_layers)]
    if engine is not None:
        command += ["--engine", engine.model_dump_json(), "--gpu-share", str(gpu_share)]
    if cpu_repack is not None:
        command += ["--cpu-repack", str(int(cpu_repack))]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelCheckFailed(f"loading {path} took over {CHECK_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        raise ModelCheckFailed(
            f"llama.cpp cannot serve {path}: {exit_description(done.returncode, done.stderr)}"
        )
    return ModelReport(**json.loads(done.stdout.strip().splitlines()[-1]))


def _report(
    path: str, n_gpu_layers: int, cpu_repack: bool | None, fits: tuple[EngineConfig, float] | None
) -> ModelReport:
    from baton_serve.replicas.engine.device_memory import check_fits
    from baton_serve.replicas.engine.ggml_backends import ensure_loaded
    from baton_serve.replicas.engine.llama_context import BatchEntry, ContextParams, LlamaContext
    from baton_serve.replicas.engine.llama_model import LlamaModel, ModelLoadError

    try:
        if fits is not None:
            check_fits(path, fits[0], share=fits[1])
        model = LlamaModel(path, n_gpu_layers=n_gpu_layers, cpu_repack=cpu_repack)
    except ModelLoadError as exc:
        raise SystemExit(str(exc)) from exc
    with model, LlamaContext(model, ContextParams(64, 1, 8, 2)) as context:
        context.decode([BatchEntry(0, model.any_token, p, p == 7) for p in range(8)])
        return ModelReport(
            kind=model.kind.value,
            n_vocab=model.n_vocab,
            n_ctx_train=model.n_ctx_train,
            has_bos=model.bos_token is not None,
            has_eos=model.eos_token is not None,
            has_chat_template=bool(model.chat_template),
            has_text=model.has_text,
            cpu_backend=ensure_loaded().name,
            cpu_repack=model.cpu_repack,
            device=model.device,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton_serve.replicas.models.model_check")
    parser.add_argument("path")
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--cpu-repack", type=int, choices=(0, 1))
    parser.add_argument("--engine", help="an EngineConfig as JSON: check it fits the device")
    parser.add_argument("--gpu-share", type=float, default=1.0)
    args = parser.parse_args(argv)
    repack = None if args.cpu_repack is None else bool(args.cpu_repack)
    fits = None
    if args.engine:
        fits = (EngineConfig.model_validate_json(args.engine), args.gpu_share)
    report = _report(args.path, args.n_gpu_layers, repack, fits)
    print(json.dumps(report.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
