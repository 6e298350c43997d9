"""Turn a model argument into a GGUF file: a path, `tiny:ARCH`, `hf://...`, or the default model."""

from __future__ import annotations

import os
from pathlib import Path

from baton_serve.replicas.models.default_model import default_model_path
from baton_serve.replicas.models.hf_hub import HF_PREFIX, hub_download, parse_hf_ref
from baton_serve.replicas.models.tiny_model import ARCHITECTURES, DEFAULT_EMBD, write_tiny_model
from baton_serve.replicas.models.tiny_projector import write_tiny_projector

TINY_PREFIX = "tiny:"


def model_cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton")) / "models"


def resolve_model(spec: str | None) -> Path:
    """None → SmolLM2 (default); ``tiny:ARCH`` → a generated tiny model; ``hf://ORG/REPO/PATH``
    → the file downloaded from the Hugging Face hub into the cache; else a file path."""
    if not spec:
        return default_model_path()
    if spec.startswith(HF_PREFIX):
        return hub_download(parse_hf_ref(spec), model_cache_dir())
    if spec.startswith(TINY_PREFIX):
        arch = spec[len(TINY_PREFIX) :]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown tiny model {arch!r}; choose from {', '.join(ARCHITECTURES)}")
        path = model_cache_dir() / f"tiny-{arch}.gguf"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            write_tiny_model(arch, partial)
            partial.replace(path)
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    return path


def resolve_projector(spec: str, model_path: Path) -> Path:
    """A projector argument as a file: ``tiny:ARCH`` → the generated projector for the
    generated model ``tiny:ARCH`` (`model_path`), ``hf://…`` → downloaded, else a file path."""
    if spec.startswith(TINY_PREFIX):
        arch = spec[len(TINY_PREFIX) :]
        path = model_cache_dir() / f"tiny-{arch}-mmproj.gguf"
        if model_path != model_cache_dir() / f"tiny-{arch}.gguf":
            raise ValueError(f"mmproj {spec} is generated for the model {spec}, not {model_path}")
        if not path.is_file():
            partial = path.with_suffix(".partial")
            write_tiny_projector(partial, arch=arch, n_embd_text=DEFAULT_EMBD)
            partial.replace(path)
        return path
    return resolve_model(spec)
