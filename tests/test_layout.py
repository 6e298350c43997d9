"""The project's rooms: imports run one way, no cycles, no module over 600 lines (those over
400 named in the run's warnings), and the `baton_serve` namespace installs beside other
distributions' `router` and `deploy`.

The rooms and what each may import are the rooms table of `docs/architecture.md`, read here.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "baton_serve"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TOP_FOLDERS = ("cache_store", "replicas", "router", "deploy", "loadtests")


def _dotted(cell: str) -> str:
    """`replicas/engine/` → `replicas.engine`."""
    return cell.strip().strip("`").strip("/").replace("/", ".")


def read_rooms(text: str) -> dict[str, set[str] | None]:
    """Room → the rooms it may import (None: every room), from the rooms table: the
    first table after the `rooms:` marker, its first and last columns."""
    lines = text[text.index("<!-- rooms:") :].splitlines()[1:]
    rooms: dict[str, set[str] | None] = {}
    for line in lines[2:]:  # after the header and its rule
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        may = cells[-1]
        found = {_dotted(c) for c in re.findall(r"`([^`]+)`", may)}
        rooms[_dotted(cells[0])] = None if may == "everything" else found
    assert rooms, "no rooms table in docs/architecture.md"
    return rooms


ALLOWED = read_rooms(ARCHITECTURE.read_text())
# Past SPLIT_SIGNAL_LINES a module is named in the run's warnings (a reviewer's cue to split
# it by job, never to compact it); past MAX_LINES the test fails.
SPLIT_SIGNAL_LINES = 400
MAX_LINES = 600


def _room(module: str) -> str:
    """`baton_serve.replicas.engine.engine` → `replicas.engine`."""
    parts = module.split(".")[1:]
    for depth in (2, 1):
        if ".".join(parts[:depth]) in ALLOWED:
            return ".".join(parts[:depth])
    raise AssertionError(f"{module} is in no room")


def _modules() -> dict[str, Path]:
    found = {}
    for room in TOP_FOLDERS:
        for path in (ROOT / room).rglob("*.py"):
            relative = path.relative_to(ROOT).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            if path.name == "__init__.py" and ".".join(parts) not in ALLOWED:
                # a folder split into rooms (`router/`): its package file is a docstring only
                assert not _imports(path), f"{path} imports code but is in no room"
                continue
            found[".".join([NAMESPACE, *parts])] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every `baton_serve` module or name this file imports, at any depth (a deferred import
    is still an arrow)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith(NAMESPACE + ".")}


def test_every_import_points_down() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        room = _room(module)
        for target in _imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]  # `from pkg import name`: the module
            if target not in modules:
                continue
            other = _room(target)
            allowed = ALLOWED[room]
            if other != room and allowed is not None and other not in allowed:
                wrong.append(f"{module} ({room}) imports {target} ({other})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for target in _imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                graph[module].add(target)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(graph[module]):
            if seen.get(target) == 1:
                raise AssertionError("import cycle: " + " → ".join([*path, module, target]))
            if target not in seen:
                visit(target, [*path, module])
        seen[module] = 2

    for module in sorted(modules):
        if module not in seen:
            visit(module, [])


def test_modules_stay_small() -> None:
    lines = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in _modules().values()
    }
    long = {path: n for path, n in sorted(lines.items()) if n > SPLIT_SIGNAL_LINES}
    if long:
        listed = ", ".join(f"{path} ({n})" for path, n in long.items())
        warnings.warn(f"modules over {SPLIT_SIGNAL_LINES} lines: {listed}", stacklevel=1)
    assert max(lines.values()) <= MAX_LINES, {p: n for p, n in long.items() if n > MAX_LINES}


@pytest.mark.slow
def test_installs_beside_other_router_and_deploy_packages(tmp_path: Path) -> None:
    """A wheel of Baton next to other distributions' top-level `router` and `deploy`:
    neither shadows the other, and the command line runs."""
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    site = tmp_path / "site"
    for other in ("router", "deploy", "replicas"):
        (site / other).mkdir(parents=True)
        (site / other / "__init__.py").write_text(f"OWNER = 'another {other} distribution'\n")
    (wheel,) = wheels.glob("baton_serve-*.whl")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    check = (
        "import router, deploy, replicas, baton_serve.router.gateway.gateway as g;"
        "from baton_serve.deploy.cli import main;"
        f"assert g.__file__.startswith({str(site)!r}), g.__file__;"
        "assert router.OWNER == 'another router distribution';"
        "assert deploy.OWNER == 'another deploy distribution';"
        "raise SystemExit(main(['make-model', '--help']))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "--no-chat-template" in done.stdout


def test_every_room_is_a_package_pyproject_ships() -> None:
    """A folder that holds modules is in pyproject's package list (or its wheel lacks it)
    and in the rooms table (or its imports go unchecked)."""
    import tomllib

    packaged = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        ".".join([NAMESPACE, *path.parent.relative_to(ROOT).parts])
        for room in TOP_FOLDERS
        for path in (ROOT / room).rglob("*.py")
    }
    assert folders - packaged == set()
    assert {f.removeprefix(NAMESPACE + ".") for f in folders} - set(ALLOWED) <= set(TOP_FOLDERS)
