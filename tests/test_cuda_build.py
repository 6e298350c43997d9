"""llama.cpp's CUDA backend compiles without a GPU, from NVIDIA's PyPI wheels.

Every run: the toolkit `deploy/cuda_build.py` uses (the system's where it has cuBLAS, else
CUDA 13.0 laid out from NVIDIA's wheels) compiles one kernel file of the vendored ggml-cuda
for sm_90 and links it against the CUDA runtime and cuBLAS as ggml does. The whole module
takes about an hour on 2 cores, so it is `make cuda`'s job, not the test run's: where it is
built (cached or installed), its ELF is checked and it is loaded without a GPU, which must
be one clear warning (the missing CUDA library or driver named), never a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton_serve.deploy import cuda_build, llama_build

KERNEL = "arange.cu"  # one of ggml-cuda's smallest files: a few seconds to compile
ARCH = "90"
CHILD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def kit() -> cuda_build.Toolkit:
    return cuda_build.toolkit(cuda_build.default_cache())


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("sdist")
    return llama_build.vendored_source(llama_build.download_sdist(scratch), scratch / "src")


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


def needed(library: Path) -> list[str]:
    return [
        ln.split("[", 1)[1].rstrip("]")
        for ln in readelf("-d", str(library)).splitlines()
        if "(NEEDED)" in ln
    ]


def test_wheel_toolkit_compiles_and_links_a_ggml_cuda_kernel(
    kit: cuda_build.Toolkit, vendored: Path, tmp_path: Path
) -> None:
    assert kit.version.startswith("13."), kit
    ggml = vendored / "ggml"
    obj = tmp_path / "kernel.o"
    compile_ = [
        str(kit.nvcc), "-x", "cu", "-c", "-std=c++17", "-O3", "-use_fast_math",
        "-extended-lambda", f"--generate-code=arch=compute_{ARCH},code=[compute_{ARCH},sm_{ARCH}]",
        "-Xcompiler=-fPIC", "-DGGML_BACKEND_BUILD", "-DGGML_BACKEND_SHARED", "-DGGML_SHARED",
        f"-I{ggml / 'src'}", f"-I{ggml / 'include'}", str(ggml / "src" / "ggml-cuda" / KERNEL),
        "-o", str(obj),
    ]  # fmt: skip
    subprocess.run(compile_, check=True, timeout=600)
    assert ".nv_fatbin" in readelf("-S", str(obj)), "no device code in the object"
    library = tmp_path / "libkernel.so"
    # cuBLAS linked even though this kernel calls none of it: the link itself is the check.
    libs = ["-Xlinker=--no-as-needed", "-lcublas", "-lcudart"]
    link = [str(kit.nvcc), "-shared", str(obj), *libs, "-o", str(library)]
    subprocess.run(link, check=True, timeout=300)
    assert {"libcudart.so.13", "libcublas.so.13"} <= set(needed(library)), needed(library)


def defined_symbols(library: Path) -> set[str]:
    rows = (ln.split() for ln in readelf("--dyn-syms", "-W", str(library)).splitlines())
    return {f[7].split("@")[0] for f in rows if len(f) >= 8 and f[6] != "UND"}


def test_the_driver_stub_defines_what_ggml_cuda_calls(kit: cuda_build.Toolkit) -> None:
    """ggml-cuda's VMM pool calls the driver API; a stub without those symbols is dropped by
    `--as-needed`, and the module then fails to load (`undefined symbol: cuDeviceGet`)."""
    stubs = [kit.root / d / "stubs" / "libcuda.so" for d in ("lib64", "lib")]
    library = next(p for p in stubs if p.is_file())
    assert "Library soname: [libcuda.so.1]" in readelf("-d", str(library))
    used = {"cuDeviceGet", "cuDeviceGetAttribute", "cuGetErrorString", "cuMemCreate", "cuMemMap"}
    used |= {"cuMemAddressReserve", "cuMemAddressFree", "cuMemRelease", "cuMemSetAccess"}
    assert used <= defined_symbols(library), used - defined_symbols(library)


def built_module(kit: cuda_build.Toolkit) -> Path:
    """The module `make cuda` built (cached, else installed); skips the test without one."""
    cached = cuda_build.module_folder(cuda_build.cuda_cmake_args(), kit, cuda_build.default_cache())
    lib = llama_build.installed_lib_dir()
    for module in (cached / cuda_build.MODULE, (lib or cached) / cuda_build.MODULE):
        if module.is_file():
            return module
    pytest.skip(f"no {cuda_build.MODULE} built for sm_{ARCH}: `make cuda` builds it (~1 h)")


def test_module_exports_the_backend_entry_points(kit: cuda_build.Toolkit) -> None:
    module = built_module(kit)
    symbols = defined_symbols(module)
    assert "ggml_backend_init" in symbols
    # ggml_backend_score is optional (only CPU variants have one today); a stray one is checked.
    assert "ggml_backend_score" not in readelf("--dyn-syms", "-W", str(module)) or (
        "ggml_backend_score" in symbols
    )
    libraries = needed(module)
    for name in ("libcudart.so.13", "libcublas.so.13", "libcuda.so.1", "libggml-base.so.0"):
        assert name in libraries, (name, libraries)


LOAD = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
from baton_serve.replicas.engine import ggml_backends as g
loaded = g.load_gpu_module(Path(sys.argv[1]))
lib = g.libggml
names = [lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i)).decode()
         for i in range(lib.ggml_backend_dev_count())]
print(json.dumps({"loaded": loaded, "devices": names}))
"""


@pytest.mark.parametrize("runtime", ["system", "toolkit"])
def test_module_without_a_gpu_is_one_clear_warning(kit: cuda_build.Toolkit, runtime: str) -> None:
    """With the system's libraries, and with the toolkit's CUDA runtime and cuBLAS found (so
    that only a driver can be missing): the module loads and names its CUDA devices, or is
    one warning naming what is missing; the process goes on either way."""
    module = built_module(kit)
    env = dict(os.environ)
    if runtime == "toolkit":
        env["LD_LIBRARY_PATH"] = f"{kit.root / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(module)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    warnings = [ln for ln in done.stderr.splitlines() if ln.startswith("WARNING baton.backends")]
    if result["loaded"]:
        assert not warnings, warnings
        assert all(name.startswith("CUDA") for name in result["devices"]), result
        return
    (warning,) = warnings
    assert f"{cuda_build.MODULE} not loaded" in warning, warning
    missing = ("libcuda.so.1",) if runtime == "toolkit" else ("libcuda", "libcublas", "libcudart")
    assert any(name in warning for name in missing), warning
    assert not any(name.startswith("CUDA") for name in result["devices"]), result
