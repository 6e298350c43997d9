"""Shared fixtures: tiny generated models (one per architecture per session) and engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# First: sets Ray's environment before anything imports ray.
from fixtures_ray import ray_cluster, serve_port  # noqa: F401
from fixtures_redis import (  # noqa: F401
    private_redis_cluster,
    private_redis_sentinel,
    private_redis_server,
    redis_cluster,
    redis_sentinel,
    redis_server,
)

from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.tiny_model import DEFAULT_EMBD, write_tiny_model
from baton_serve.replicas.models.tiny_projector import write_tiny_projector
from baton_serve.router.gateway.prompt_builder import PromptBuilder

HMAC_KEY = b"test-cluster-key"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model(arch)` → path of a generated model, written once per test session."""
    folder = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(arch, folder / f"{arch}.gguf")
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_projector(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """`tiny_projector(arch)` → a generated projector (images and audio) for `tiny_model(arch)`."""
    folder = tmp_path_factory.mktemp("projectors")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_projector(
                folder / f"{arch}-mmproj.gguf", arch=arch, n_embd_text=DEFAULT_EMBD
            )
        return made[arch]

    return get


@pytest.fixture
def builder(request, tiny_model, tiny_projector) -> Iterator[PromptBuilder]:
    """The gateway's prompt builder for `tiny_model(arch)` with its projector (`arch`: the
    test's indirect parameter)."""
    arch = request.param
    built = PromptBuilder(
        tiny_model(arch), block_tokens=16, n_ctx=1024, mmproj=str(tiny_projector(arch))
    )
    yield built
    built.close()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """`make_engine(path, **config)` → a running engine, closed after the test."""
    engines: list[Engine] = []

    def make(path: Path, mmproj: Path | None = None, **config: object) -> Engine:
        settings = {"n_ctx": 1024, "n_slots": 2, "n_threads": 2, **config}
        projector = str(mmproj) if mmproj else None
        engine = Engine(str(path), EngineConfig(**settings), hmac_key=HMAC_KEY, mmproj=projector)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
