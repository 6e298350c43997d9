"""A llama-server process for a benchmark: built from Baton's vendored llama.cpp, on the CPU
backend module Baton's own engine loads, on a free port; stopped at the end."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import llama_cpp

from baton_serve.deploy.llama_build import LLAMA_CPP_PYTHON_VERSION
from baton_serve.deploy.llama_server_build import cached_server
from baton_serve.deploy.ports import free_port
from baton_serve.replicas.engine.ggml_backends import cpu_choice, lib_dir

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerSettings:
    """What llama-server is started with: `-t threads -np slots -c slots x n_ctx --jinja
    -fa on|off` (flash attention as Baton's engines compute attention, not its `auto`)."""

    threads: int
    slots: int
    n_ctx: int  # per slot
    flash_attn: bool
    mmproj: Path | None = None  # `--mmproj`: the image projector


def server_command(binary: Path, model: Path, settings: ServerSettings, port: int) -> list[str]:
    command = [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(settings.threads), "-np", str(settings.slots)),
        *("-c", str(settings.slots * settings.n_ctx), "--jinja", "--no-webui"),
        *("-fa", "on" if settings.flash_attn else "off"),
    ]
    if settings.mmproj is not None:
        command += ["--mmproj", str(settings.mmproj.resolve())]
    if not cpu_choice().repack_safe:  # Baton's engine turns it off here too (AMX on this VM)
        command.append("--no-repack")
    return command


def _backend_dir(into: Path) -> None:
    """`into` holds only the CPU variant Baton's backend test chose: ggml loads backends from
    the working directory, and would otherwise rank one this machine cannot run first."""
    variant = cpu_choice().variant
    if variant is not None:
        (into / variant).symlink_to(lib_dir() / variant)


@contextlib.contextmanager
def llama_server(model: Path, settings: ServerSettings, log: Path | None = None) -> Iterator[str]:
    """A running llama-server for `model`; yields its base URL once `/health` answers."""
    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:  # its CPU modules serve the server
        raise RuntimeError(
            f"llama-cpp-python {llama_cpp.__version__} is installed; the llama-server build "
            f"and its CPU backend need {LLAMA_CPP_PYTHON_VERSION} (make install)"
        )
    binary = cached_server()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="baton-llama-server-") as workdir:
        _backend_dir(Path(workdir))
        out = open(log or Path(workdir) / "server.log", "w")  # noqa: SIM115
        process = subprocess.Popen(
            server_command(binary, model.resolve(), settings, port),  # it runs in workdir
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, process, Path(out.name))
            yield url
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            out.close()


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited with {process.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"llama-server at {url} never became healthy")
