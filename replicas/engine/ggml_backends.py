"""llama.cpp's compute backends: which CPU variant runs here, loaded once per process.

Baton's llama.cpp is built like llama.cpp's releases (`deploy/llama_build.py`): every CPU
variant (x64, haswell, skylakex, icelake, zen4, sapphirerapids, …) and any GPU backend is a
module in `llama_cpp/lib`, and nothing is registered until a module is loaded.
llama-cpp-python does not load them, so this module does, through ggml's C API (ctypes).

ggml ranks CPU variants by the features CPUID advertises, and a CPU may advertise what
the VM does not let a process run (AMX here). So the choice is *tested*: a child process
loads a variant and runs a small quantized model with weight repacking on (the path AMX
and the AVX2/AVX-512 repacked kernels take), then off; the first that survives wins, and
the verdict is cached per machine (`cpu_choice`). A build without variant modules (one CPU
backend linked in) is tested the same way for weight repacking only.
`offload_devices` names the GPU devices that the loaded modules registered.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp

logger = logging.getLogger("baton.backends")

PROBE_TIMEOUT_S = 180.0
CPU_VARIANT_PREFIX = "libggml-cpu-"
DEVICE_GPU, DEVICE_IGPU = 1, 2  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL

_lock = threading.Lock()
_loaded: CpuChoice | None = None


class BackendUnavailable(RuntimeError):
    """No llama.cpp CPU backend runs on this machine."""


@dataclass(frozen=True)
class CpuChoice:
    """The CPU backend module to load (None: linked into libggml) and whether weight
    repacking (llama.cpp's `use_extra_bufts`: AMX and interleaved CPU kernels) is safe."""

    variant: str | None
    repack_safe: bool

    @property
    def name(self) -> str:
        if self.variant is None:
            return "built-in"
        return self.variant.removeprefix(CPU_VARIANT_PREFIX).removesuffix(".so")


def lib_dir() -> Path:
    return Path(llama_cpp.__file__).resolve().parent / "lib"


def _load_libggml() -> ctypes.CDLL:
    """The libggml that libllama uses, whose backend registry llama.cpp reads.

    Opened by its soname (already loaded with libllama), not as `libggml.so`: a wheel keeps
    `libggml.so` and `libggml.so.0` as two files, and loading the other one would fill a
    second registry that llama.cpp never sees (as `llama_cpp._ggml` does).
    """
    sonames = sorted(lib_dir().glob("libggml.so.*"), key=lambda p: len(p.name))
    library = ctypes.CDLL(sonames[0].name if sonames else str(lib_dir() / "libggml.so"))
    library.ggml_backend_load.restype = ctypes.c_void_p
    library.ggml_backend_load.argtypes = [ctypes.c_char_p]
    library.ggml_backend_dev_count.restype = ctypes.c_size_t
    library.ggml_backend_dev_count.argtypes = []
    library.ggml_backend_dev_get.restype = ctypes.c_void_p
    library.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    library.ggml_backend_dev_type.restype = ctypes.c_int
    library.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    for text in ("name", "description"):
        getattr(library, f"ggml_backend_dev_{text}").restype = ctypes.c_char_p
        getattr(library, f"ggml_backend_dev_{text}").argtypes = [ctypes.c_void_p]
    return library


libggml = _load_libggml()


def cpu_variants() -> list[Path]:
    return sorted(lib_dir().glob(f"{CPU_VARIANT_PREFIX}*.so"))


def gpu_modules() -> list[Path]:
    """Backend modules other than the CPU variants (CUDA, Vulkan, …) that this build has."""
    core = {"libggml.so", "libggml-base.so", "libllama.so", "libmtmd.so"}
    return [
        p
        for p in sorted(lib_dir().glob("libggml-*.so"))
        if p.name not in core and not p.name.startswith(CPU_VARIANT_PREFIX)
    ]


def variant_score(path: Path) -> int:
    """The module's own score for this CPU (0: unsupported); loads it into this process."""
    module = ctypes.CDLL(str(path))
    score = getattr(module, "ggml_backend_score", None)
    if score is None:
        return 0
    score.restype = ctypes.c_int
    return int(score())


def load_gpu_module(path: Path) -> bool:
    """Register a GPU backend module, with no device where it finds none (ggml's Vulkan
    skips CPU-type devices such as lavapipe unless named). A module that cannot load
    (e.g. CUDA's without `libcudart.so.13` or an NVIDIA driver) is one warning, not an
    error: its layers then run on the CPU."""
    if libggml.ggml_backend_load(str(path).encode()):
        return True
    try:  # ggml logs dlopen's reason only through its own log; ask dlopen again
        ctypes.CDLL(str(path))
        reason = "the backend did not initialise"
    except OSError as exc:
        reason = str(exc)
    logger.warning("llama.cpp GPU module %s not loaded: %s", path.name, reason)
    return False


def ensure_loaded() -> CpuChoice:
    """Load this machine's CPU backend (and any GPU backend) once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            choice = cpu_choice()
            if choice.variant is not None:
                for module in gpu_modules():
                    load_gpu_module(module)
                if not libggml.ggml_backend_load(str(lib_dir() / choice.variant).encode()):
                    raise BackendUnavailable(f"ggml could not load {choice.variant}")
            if libggml.ggml_backend_dev_count() == 0:
                raise BackendUnavailable("llama.cpp has no compute device after loading")
            _loaded = choice
            logger.info("llama.cpp CPU backend: %s (repack %s)", choice.name, choice.repack_safe)
        return _loaded


def offload_devices() -> list[str]:
    """The devices llama.cpp offloads a model's layers to, as "name: description": like
    llama.cpp's own default, every discrete GPU, else the integrated ones. Empty when this
    process has none: layers asked for on a GPU then run on the CPU."""
    ensure_loaded()
    found: dict[int, list[str]] = {DEVICE_GPU: [], DEVICE_IGPU: []}
    for index in range(libggml.ggml_backend_dev_count()):
        device = libggml.ggml_backend_dev_get(index)
        kind = libggml.ggml_backend_dev_type(device)
        if kind in found:
            name = libggml.ggml_backend_dev_name(device).decode(errors="replace")
            description = libggml.ggml_backend_dev_description(device).decode(errors="replace")
            found[kind].append(f"{name}: {description}")
    return found[DEVICE_GPU] or found[DEVICE_IGPU]


def system_info() -> str:
    """llama.cpp's own account of the backends and ISA features it uses."""
    ensure_loaded()
    return llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()


# ---- the tested choice, cached per machine ----------------------------------------------


def _machine_key() -> str:
    """What the verdict depends on: the CPU, the kernel, and the llama.cpp build."""
    cpu = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor()
    modules = [(p.name, p.stat().st_size) for p in sorted(lib_dir().glob("*.so"))]
    text = json.dumps([cpu, platform.release(), llama_cpp.__version__, modules])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    base = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
    return base / "cpu-backend" / f"{_machine_key()}.json"


def cpu_choice() -> CpuChoice:
    """This machine's CPU backend: from the cache, or tested in child processes now."""
    cache = _cache_file()
    try:
        return CpuChoice(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    choice = _tested_choice()
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(asdict(choice)) + "\n")
    partial.replace(cache)
    return choice


def _tested_choice() -> CpuChoice:
    variants: list[str | None] = [None]
    if cpu_variants():
        ranked = json.loads(_run_probe(["scores"], capture=True) or "[]")
        variants = [name for name, score in ranked if score > 0]
        if not variants:
            raise BackendUnavailable("no llama.cpp CPU variant supports this CPU")
    failures = []
    for variant in variants:
        for repack in (True, False):
            args = ["run", "--repack", str(int(repack))]
            if variant is not None:
                args += ["--variant", variant]
            try:
                _run_probe(args)
            except _ProbeCrashed as exc:
                failures.append(f"{variant or 'built-in'} (repack {repack}): {exc}")
                logger.warning("llama.cpp CPU backend %s failed its test: %s", variant, exc)
                continue
            if failures:
                logger.warning("chose %s (repack %s) after: %s", variant, repack, failures)
            return CpuChoice(variant=variant, repack_safe=repack)
    raise BackendUnavailable("every llama.cpp CPU backend failed its test: " + "; ".join(failures))


class _ProbeCrashed(RuntimeError):
    """The probe died (a signal, or no answer): this backend cannot run here."""


def _run_probe(args: list[str], *, capture: bool = False) -> str:
    command = [sys.executable, "-m", "baton_serve.replicas.models.backend_probe", *args]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise _ProbeCrashed(f"no answer in {PROBE_TIMEOUT_S:.0f} s") from exc
    if done.returncode < 0:
        raise _ProbeCrashed(exit_description(done.returncode, done.stderr))
    if done.returncode != 0:  # an error, not a crash: the build or the probe is broken
        raise BackendUnavailable(
            f"the llama.cpp backend test failed: {exit_description(done.returncode, done.stderr)}"
        )
    return done.stdout if capture else ""


def exit_description(returncode: int, stderr: str) -> str:
    """How a child process ended, for an error message: its signal or last error line."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        cause = f"killed by {name}"
    else:
        cause = f"exit code {returncode}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return f"{cause}: {lines[-1]}" if lines else cause
