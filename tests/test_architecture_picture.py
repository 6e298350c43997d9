"""The picture at the top of docs/architecture.md matches the code.

Every room of the rooms table (the one tests/test_layout.py checks imports against) is on it,
on a floor above every room it may import; every file it names exists; every class, function,
method and module it names is defined in the rooms. A rename or a moved room fails here until
the picture follows.
"""

from __future__ import annotations

import ast
import re

import pytest
from test_layout import ALLOWED, ARCHITECTURE, ROOT, TOP_FOLDERS

# Names in the picture that are Ray's, Kubernetes' or OpenAI's, not Baton's.
NOT_BATONS = {"KubeRay", "RayService", "ObjectRef", "OpenAI"}
ROOM = re.compile(r"(?<![\w/])([a-z_]+(?:/[a-z_]+)?)/(?![\w/])")


def picture() -> str:
    text = ARCHITECTURE.read_text()
    fence = text.index("```\n", text.index("<!-- picture:"))
    return text[fence + 4 : text.index("```", fence + 4)]


def floors(rooms_part: str) -> list[set[str]]:
    """The rooms on each floor of the picture's rooms part, top floor first."""
    chunks = re.split(r"^\s*─+\s*$", rooms_part, flags=re.M)
    found = [{m.replace("/", ".") for m in ROOM.findall(chunk)} for chunk in chunks]
    return [rooms & set(ALLOWED) for rooms in found if rooms & set(ALLOWED)]


def code_names() -> tuple[set[str], dict[str, set[str]], set[str]]:
    """Every name the rooms define (classes, functions, methods, modules, folders), the names
    defined inside each module and class, and the rooms' file names."""
    names: set[str] = set()
    inside: dict[str, set[str]] = {}
    files: set[str] = set()
    for room in TOP_FOLDERS:
        for path in (ROOT / room).rglob("*.py"):
            files.add(path.name)
            names.update([path.stem, *path.relative_to(ROOT).parent.parts])
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                    inside.setdefault(path.stem, set()).add(node.name)
                if isinstance(node, ast.ClassDef):
                    inside.setdefault(node.name, set()).update(
                        n.name for n in ast.walk(node) if hasattr(n, "name")
                    )
    return names, inside, files


def check_floors(rooms_part: str) -> None:
    """Each room on one floor, every room it may import on a floor below."""
    floor_of: dict[str, int] = {}
    for level, rooms in enumerate(floors(rooms_part)):
        for room in rooms:
            assert room not in floor_of, f"{room} is drawn on two floors"
            floor_of[room] = level
    assert set(floor_of) == set(ALLOWED), set(ALLOWED) ^ set(floor_of)
    for room, may in ALLOWED.items():
        for other in may or ():
            assert floor_of[other] > floor_of[room], (
                f"{room} imports {other}, drawn beside or above"
            )


def check_names(drawn: str) -> None:
    """Every file, class, function, method and module named in `drawn` is in the rooms."""
    names, inside, files = code_names()
    for path in re.findall(r"[\w/]+\.py\b", drawn):
        assert (ROOT / path).exists() if "/" in path else path in files, path
    without_files = re.sub(r"[\w/]+\.py\b", "", drawn)
    for owner, name in re.findall(r"\b(\w+)\.(\w+)\b", without_files):
        if owner in inside or "_" in owner or owner[0].isupper():  # not `llama.cpp`
            assert name in inside.get(owner, set()), f"{owner}.{name}"
    for name in re.findall(r"\b[A-Z][a-z]+[A-Z]\w*\b", drawn):
        assert name in names or name in NOT_BATONS, name
    for name in re.findall(r"\b[a-z]+(?:_[a-z0-9]+)+\b", without_files):
        assert name in names, name


def test_every_room_is_on_one_floor_above_the_rooms_it_may_import() -> None:
    check_floors(picture().split("A REQUEST'S PATH")[0])


def test_every_file_and_name_on_the_picture_is_in_the_code() -> None:
    check_names(picture())


def test_the_picture_fits_one_screen() -> None:
    lines = picture().splitlines()
    assert len(lines) <= 50 and max(map(len, lines)) <= 100


def test_a_picture_that_drifts_from_the_code_fails() -> None:
    """A class renamed, a method moved, a room drawn beside one it imports: each caught."""
    drawn = picture()
    for drift in ("BatonRouterX (request_router.py)", "route_decision.plan_for", "engine2.py"):
        with pytest.raises(AssertionError):
            check_names(drawn + drift)
    rooms_part = drawn.split("A REQUEST'S PATH")[0]
    sunk = rooms_part.replace("router/routing/", "").replace(
        "cache_store/index/ ", "cache_store/index/ router/routing/ "
    )
    with pytest.raises(AssertionError, match="router.routing imports"):
        check_floors(sunk)
