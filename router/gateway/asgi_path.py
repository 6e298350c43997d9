"""The path of a request within the ASGI app that serves it."""

from __future__ import annotations

from starlette.types import Scope


def app_path(scope: Scope) -> str:
    """`scope["path"]` without the `root_path` the app is mounted at (a Serve route prefix
    such as `/baton`): Starlette's `path` includes it, middleware matching `/v1/` must not."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
