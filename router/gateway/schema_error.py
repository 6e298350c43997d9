"""The error for a JSON-schema keyword Baton cannot enforce, and JSON pointers to name it."""

from __future__ import annotations


class SchemaError(ValueError):
    """A schema Baton cannot enforce: `keyword` at JSON pointer `path`."""

    def __init__(self, keyword: str, path: str, reason: str) -> None:
        self.keyword, self.path = keyword, path
        super().__init__(
            f"JSON schema keyword '{keyword}' at '{path or '/'}' is not supported: {reason}"
        )


def pointer(path: str, key: str | int) -> str:
    """`path` extended by `key`, escaped as RFC 6901 says."""
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
