"""A private, throw-away `redis-server` for tests and benchmarks (no persistence)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis

from baton_serve.deploy.ports import free_port


def redis_server_path() -> str | None:
    """Return the `redis-server` executable on PATH, or None."""
    return shutil.which("redis-server")


class RedisServer:
    """`redis-server` on 127.0.0.1:`port` that can be stopped, paused and restarted.

    Restarting keeps the port (so clients reconnect) but not the data.
    """

    def __init__(
        self,
        port: int | None = None,
        start_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        executable = redis_server_path()
        if executable is None:
            raise FileNotFoundError("redis-server is not on PATH (try `make redis-server`)")
        self.executable = executable
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)  # more `--name value` settings
        self.leading_args: tuple[str, ...] = ()  # before the flags: a config file, `--sentinel`
        self._dir = Path(tempfile.mkdtemp(prefix="baton-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.running:
            return
        log = self._dir / "redis.log"
        command = [
            self.executable,
            *self.leading_args,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--logfile", str(log),
            *self.extra_args,
        ]  # fmt: skip
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {_tail(log)}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.02)
        finally:
            client.close()

    @property
    def dir(self) -> Path:
        """The server's own directory (its log, a Cluster's node file)."""
        return self._dir

    def stop(self) -> None:
        """Kill the server (its data is lost) and wait until it has exited."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)  # a paused server could not exit
        process.kill()
        process.wait()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): it accepts connections but never answers."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo `pause`."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
