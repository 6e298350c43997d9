"""A local HTTP server that answers like the Hugging Face hub's resolve URLs.

`/ORG/REPO/resolve/REV/PATH` answers 302 to `http://localhost:PORT/cdn/SHA256` — the same
server under another host name, as the hub sends LFS files to its CDN — with `X-Linked-Etag`,
`X-Linked-Size` and `X-Repo-Commit` (`COMMIT` when asked for it, else `head`, which changes
with every `add`, as a push moves `main`); the CDN path serves the bytes and honours `Range` (206). A private repo
answers 401 without the right bearer token; unknown files 404 (`EntryNotFound`), unknown
revisions 404 (`RevisionNotFound`). Every request is recorded.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_test_token"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Seen:
    method: str
    path: str
    headers: Message  # names in any case, as HTTP has them


@dataclass
class FakeHub:
    files: dict[str, bytes] = field(default_factory=dict)  # "org/repo/path" → content
    private: set[str] = field(default_factory=set)  # "org/repo" needing TOKEN
    seen: list[Seen] = field(default_factory=list)
    etag: bool = True  # send X-Linked-Etag (an LFS file)
    ranges: bool = True  # the CDN honours Range
    cut_after: int | None = None  # the next CDN answer stops after this many bytes
    corrupt: bool = False  # the CDN serves other bytes than the hub's digest
    delay_s: float = 0.0  # before a CDN answer
    url: str = ""

    def add(self, name: str, content: bytes) -> str:
        self.files[name] = content
        return hashlib.sha256(content).hexdigest()

    @property
    def head(self) -> str:
        """The commit `main` is at: one per state of the files."""
        state = sorted((name, hashlib.sha256(c).hexdigest()) for name, c in self.files.items())
        return hashlib.sha1(repr(state).encode()).hexdigest()

    def requests(self, method: str, prefix: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path.startswith(prefix)]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, *, body: bool) -> None:
            hub.seen.append(Seen(self.command, self.path, self.headers))
            if self.path.startswith("/cdn/"):
                return self._cdn(self.path[len("/cdn/") :], body=body)
            match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path)
            if not match:
                return self._error(404, "RepoNotFound")
            repo, revision, path = match.groups()
            if repo in hub.private and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._error(401, "RepoNotFound")
            if revision not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            content = hub.files.get(f"{repo}/{path}")
            if content is None:
                return self._error(404, "EntryNotFound")
            sha = hashlib.sha256(content).hexdigest()
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/cdn/{sha}")
            if hub.etag:
                self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(content)))
            self.send_header("X-Repo-Commit", COMMIT if revision == COMMIT else hub.head)
            self.send_header("ETag", '"0123abcd"')  # a git blob id: not a SHA-256
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _cdn(self, sha: str, *, body: bool) -> None:
            found = [c for c in hub.files.values() if hashlib.sha256(c).hexdigest() == sha]
            if not found:
                return self._error(404, "")
            content = found[0] if not hub.corrupt else b"X" + found[0][1:]
            time.sleep(hub.delay_s)
            start = 0
            wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if wanted and hub.ranges:
                start = int(wanted[1])
                if start >= len(content):
                    return self._error(416, "")
                self.send_response(206)
                self.send_header(
                    "Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}"
                )
            else:
                self.send_response(200)
            self.send_header("ETag", '"cdn-etag-not-a-sha"')
            self.send_header("Content-Length", str(len(content) - start))
            self.end_headers()
            if not body:
                return
            data = content[start:]
            if hub.cut_after is not None:
                data, hub.cut_after = data[: hub.cut_after], None
            self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


@contextmanager
def serve_hub(hub: FakeHub) -> Iterator[FakeHub]:
    """Run `hub` on 127.0.0.1 (a free port) in a thread; `hub.url` is its endpoint."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
