"""The engine's narrow face, checked on the source: outside code holds an engine as an
`EngineFace` (which `Engine` implements), nothing outside `replicas/engine/` touches its
prefix cache (store, codec, hasher: `Engine`'s own methods stand for them), and one module
writes a slot's tokens. And a request's hash chain, carried, is not computed
again (real llama.cpp on generated models)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_face import EngineFace

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ROOM = ROOT / "replicas" / "engine"
OUTSIDE = ("cache_store", "replicas", "router", "deploy", "loadtests", "tests")
# The engine's internals: modules no one outside the room imports.
INTERNAL = ("prefix_cache", "prefix_states", "checkpoint_codec")


def _sources(folders: tuple[str, ...]) -> dict[Path, ast.Module]:
    return {
        path: ast.parse(path.read_text())
        for folder in folders
        for path in (ROOT / folder).rglob("*.py")
        if "build" not in path.relative_to(ROOT).parts
    }


def _outside() -> dict[Path, ast.Module]:
    return {p: t for p, t in _sources(OUTSIDE).items() if not p.is_relative_to(ENGINE_ROOM)}


def _public_names(module: str) -> set[str]:
    """The public methods and attributes of a module's classes (`self.x = ...` included)."""
    names = set()
    for node in ast.walk(ast.parse((ENGINE_ROOM / f"{module}.py").read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if not n.startswith("_")}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"


def test_nothing_outside_the_engine_touches_its_cache() -> None:
    internals = _public_names("prefix_cache") | _public_names("prefix_states")
    found = []
    for path, tree in _outside().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                inner = node.value
                if node.attr in ("_cache", "states"):
                    found.append(f"{_where(path, node)}: .{node.attr}")
                elif (
                    isinstance(inner, ast.Attribute)
                    and inner.attr == "cache"
                    and node.attr in internals
                ):
                    found.append(f"{_where(path, node)}: .cache.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.rsplit(".", 1)[-1] in INTERNAL:
                    found.append(f"{_where(path, node)}: imports {node.module}")
    assert not found, "\n".join(found)


def test_the_engine_is_its_face(tiny_model, make_engine) -> None:
    """`Engine` has every member `EngineFace` names, with the same signature."""
    for name, member in vars(EngineFace).items():
        if name.startswith("_") or not callable(member):
            continue
        assert inspect.signature(getattr(Engine, name)) == inspect.signature(member), name
    assert {"config", "model", "kind", "fingerprint", "stats", "n_ctx"} <= set(
        EngineFace.__annotations__
    )
    assert isinstance(make_engine(tiny_model("llama")), EngineFace)


def test_outside_code_names_the_engine_class_only_to_build_one() -> None:
    """Every annotation outside `replicas/engine/` says `EngineFace`, never `Engine`."""
    found = []
    for path, tree in _sources(("replicas", "router", "deploy", "loadtests")).items():
        if path.is_relative_to(ENGINE_ROOM):
            continue
        for node in ast.walk(tree):
            annotations: list[ast.expr | None] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args
                every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                annotations += [a.annotation for a in every] + [node.returns]
            elif isinstance(node, ast.AnnAssign):
                annotations.append(node.annotation)
            for annotation in filter(None, annotations):
                if "Engine" in {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}:
                    found.append(f"{_where(path, annotation)}: {ast.unparse(annotation)}")
    assert not found, "\n".join(found)


def test_engine_shows_no_cache() -> None:
    """`Engine` keeps its prefix cache private: no public attribute of it holds one."""
    tree = ast.parse((ENGINE_ROOM / "engine.py").read_text())
    (engine,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    public = {
        node.attr
        for node in ast.walk(engine)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and not node.attr.startswith("_")
    }
    assert public.isdisjoint({"cache", "store", "codec", "hasher", "states"}), public


def test_one_module_writes_slot_tokens() -> None:
    """Only `slots.Slot`'s methods change what a slot holds: elsewhere its tokens are read."""
    mutators = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
    found = []
    for path, tree in _sources(("replicas", "loadtests", "tests")).items():
        if path == ENGINE_ROOM / "slots.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "_tokens":
                found.append(f"{_where(path, node)}: ._tokens")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in mutators
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "tokens"
            ):
                found.append(f"{_where(path, node)}: .tokens.{node.attr}")
            elif isinstance(node, ast.Delete | ast.Assign | ast.AugAssign):
                targets = (
                    node.targets if isinstance(node, ast.Delete | ast.Assign) else [node.target]
                )
                for target in targets:
                    held = target.value if isinstance(target, ast.Subscript) else target
                    is_slot = isinstance(held, ast.Attribute) and held.attr == "tokens"
                    if is_slot and "slot" in ast.unparse(held.value).lower():
                        found.append(f"{_where(path, node)}: writes {ast.unparse(target)}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_carried_chain_is_used_not_hashed_again(arch, tiny_model, make_engine) -> None:
    """Checkpoints of a prompt that came with its chain (the gateway's) are stored under the
    hashes computed here from scratch; that the chain is used, not recomputed, shows with a
    forged one. A chain of another block size is ignored."""
    path = tiny_model(arch)
    system = "You are a careful assistant who answers in short sentences. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]

    def held_after(prefix_hashes: object) -> list[tuple[bytes, bytes]]:
        engine = make_engine(path, block_tokens=32)
        prompt = engine.chat_prompt(messages)
        chain = engine.hash_chain(prompt.tokens)
        carried = {"same": chain, "forged": [bytes(16)] * len(chain), "short": chain[:-1]}
        request = GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=3))
        engine.submit(request, carried[prefix_hashes]).result(timeout=60)
        engine.wait_idle()
        held = engine.checkpoints()
        assert held, "no checkpoint was saved"
        return [(c.prefix_hash, engine.prefix_hash(c.tokens)) for c in held]

    assert all(kept == fresh for kept, fresh in held_after("same"))
    assert any(kept != fresh for kept, fresh in held_after("forged"))
    assert all(kept == fresh for kept, fresh in held_after("short"))
