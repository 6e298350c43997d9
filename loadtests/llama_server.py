"""A llama-server process for a benchmark: built from Baton's vendored llama.cpp, on the
backend modules Baton's own engine loads, on a free port; stopped at the end."""

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
from baton_serve.replicas.engine.ggml_backends import cpu_choice, gpu_modules, lib_dir

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerSettings:
    """What llama-server is started with: `-t threads -np slots -c slots x n_ctx --jinja
    -fa on|off|auto -ngl N|all` (attention and offload as Baton's engines compute)."""

    threads: int
    slots: int
    n_ctx: int  # per slot
    flash_attn: bool | None  # None: llama.cpp's auto, where the engine resolved it so
    mmproj: Path | None = None  # `--mmproj`: the image projector
    n_gpu_layers: int = 0  # Baton's: -1 every layer


def server_command(binary: Path, model: Path, settings: ServerSettings, port: int) -> list[str]:
    command = [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(settings.threads), "-np", str(settings.slots)),
        *("-c", str(settings.slots * settings.n_ctx), "--jinja", "--no-webui"),
        *("-fa", flash_attn_flag(settings.flash_attn)),
        *("-ngl", gpu_layers(settings.n_gpu_layers)),
    ]
    if settings.mmproj is not None:
        command += ["--mmproj", str(settings.mmproj.resolve())]
    if not cpu_choice().repack_safe:  # Baton's engine turns it off here too (AMX on this VM)
        command.append("--no-repack")
    return command


def flash_attn_flag(flash_attn: bool | None) -> str:
    """llama.cpp's `-fa` for Baton's `engine.flash_attn` (None: its auto)."""
    return {True: "on", False: "off", None: "auto"}[flash_attn]


def gpu_layers(n_gpu_layers: int) -> str:
    """llama.cpp's `-ngl` for Baton's `n_gpu_layers` (Baton's -1, every layer, is its `all`;
    its own -1 is `auto`, a fit it computes)."""
    return "all" if n_gpu_layers < 0 else str(n_gpu_layers)


def backend_dir(into: Path) -> None:
    """`into` holds the backend modules Baton's engine loads, and of the CPU variants only
    the one its backend test chose: ggml loads backends from the working directory, and
    would otherwise rank one this machine cannot run first."""
    variant = cpu_choice().variant
    if variant is not None:
        (into / variant).symlink_to(lib_dir() / variant)
        for module in gpu_modules():  # a GPU's (CUDA, Vulkan): the same kernels as Baton's
            (into / module.name).symlink_to(module)


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
        backend_dir(Path(workdir))
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
