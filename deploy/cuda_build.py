"""Build llama.cpp's CUDA backend as a loadable module, without a GPU, from NVIDIA's wheels.

Like `vulkan_build`, this compiles only `libggml-cuda.so` from the vendored llama.cpp of
`llama_build.LLAMA_CPP_PYTHON_VERSION` (the wheel is `GGML_BACKEND_DL=ON`, so the module
loads beside the CPU variants in `llama_cpp/lib`). No GPU is needed to compile it.

The toolkit: the system's (`$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`) when it has nvcc
and cuBLAS; otherwise CUDA 13.0 from NVIDIA's PyPI wheels (`TOOLKIT_WHEELS`: nvcc, crt,
NVVM, the runtime, CCCL, cuBLAS), unpacked once into `~/.cache/baton/cuda/toolkit-<pins>/`
and laid out as CMake expects. The wheels have no driver library: a stub `libcuda.so`
(soname `libcuda.so.1`, as the CUDA toolkit's own stub) lets ggml link its VMM calls; the
node's NVIDIA driver provides the real one. At run time the module needs `libcudart.so.13`,
`libcublas.so.13` / `libcublasLt.so.13` (a CUDA 13 runtime) and a driver for CUDA 13 (580+).

Built once per version, flags and toolkit, in `~/.cache/baton/cuda/<key>/`. Standard library
only, like `llama_build`:
    python deploy/cuda_build.py install [--archs 90] [--extra-cmake-args ...]  # into llama_cpp/lib
    python deploy/cuda_build.py build [--archs 90] [--out DIR]   # build or reuse; copy to DIR
    python deploy/cuda_build.py toolkit   # only fetch (or find) the toolkit; print its root
    python deploy/cuda_build.py check
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from . import llama_build
except ImportError:  # run as a script: python deploy/cuda_build.py
    import llama_build  # type: ignore[no-redef]

MODULE = "libggml-cuda.so"
DEFAULT_ARCHS = "90"  # H100 / H200; more as "80;89;90"
CUDA_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CUDA=ON",
    "-DGGML_CPU=OFF",
    # Found beside libggml-base.so.0 in llama_cpp/lib (already loaded by then anyway).
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
)
# CUDA 13.0 (driver 580+). Every wheel unpacks into nvidia/cu13/{bin,include,lib,nvvm}.
TOOLKIT_WHEELS = (
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cublas==13.0.2.14",
)
WHEEL_ROOT = "nvidia/cu13/"
TARGET_DIR = "targets/x86_64-linux"  # where nvcc.profile looks for include/ and lib/
SONAME_LINKS = {"libcudart.so": "libcudart.so.13", "libcublas.so": "libcublas.so.13"}
SONAME_LINKS |= {"libcublasLt.so": "libcublasLt.so.13", "libnvvm.so": "libnvvm.so.4"}


@dataclass(frozen=True)
class Toolkit:
    """A CUDA toolkit to build with: its root, nvcc's version, and where it came from."""

    root: Path
    version: str
    origin: str

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"


def default_cache() -> Path:
    return llama_build.default_wheel_cache().parent / "cuda"


def cuda_cmake_args(archs: str = DEFAULT_ARCHS, extra: str = "") -> list[str]:
    """The flags that decide the module (the toolkit's paths are added when configuring)."""
    return [*CUDA_CMAKE_ARGS, f"-DCMAKE_CUDA_ARCHITECTURES={archs}", *shlex.split(extra)]


def nvcc_version(nvcc: Path) -> str:
    """nvcc's full version, e.g. "13.0.88"."""
    done = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True)
    found = re.search(r"\bV(\d+\.\d+\.\d+)", done.stdout)
    if not found:
        raise RuntimeError(f"{nvcc} --version names no version: {done.stdout.strip()!r}")
    return found.group(1)


def has_cublas(root: Path) -> bool:
    """Whether `root` is a toolkit that can build ggml-cuda: nvcc, cuBLAS headers and library."""
    include = [root / "include", root / TARGET_DIR / "include"]
    lib = [root / "lib64", root / "lib", root / TARGET_DIR / "lib"]
    return (
        (root / "bin" / "nvcc").is_file()
        and any((d / "cublas_v2.h").is_file() for d in include)
        and any((d / "libcublas.so").exists() for d in lib)
    )


def system_toolkit() -> Toolkit | None:
    """The machine's own CUDA toolkit, if one has everything ggml-cuda needs."""
    env = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")]
    on_path = shutil.which("nvcc")
    roots = [Path(p) for p in env if p] + [Path("/usr/local/cuda")]
    roots += [Path(on_path).resolve().parent.parent] if on_path else []
    for root in dict.fromkeys(r.resolve() for r in roots if _is_elf(r / "bin" / "nvcc")):
        if has_cublas(root):
            return Toolkit(root, nvcc_version(root / "bin" / "nvcc"), f"the system ({root})")
        print(f"the system's CUDA at {root} has no cuBLAS: not used")
    return None


def _is_elf(path: Path) -> bool:
    """A real nvcc, not a wrapper script (whose folder is no toolkit)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"\x7fELF"
    except OSError:
        return False


def pypi_toolkit(cache: Path) -> Toolkit:
    """CUDA from `TOOLKIT_WHEELS`, downloaded and laid out once under `cache`."""
    pins = "-".join(w.split("==")[1] for w in TOOLKIT_WHEELS[:1] + TOOLKIT_WHEELS[-1:])
    root = cache / f"toolkit-{pins}"
    origin = f"NVIDIA's PyPI wheels ({', '.join(TOOLKIT_WHEELS)})"
    if (root / "wheels.txt").is_file() and has_cublas(root):
        return Toolkit(root, nvcc_version(root / "bin" / "nvcc"), origin)
    with tempfile.TemporaryDirectory(dir=_made(cache), prefix=".toolkit-") as scratch_dir:
        scratch = Path(scratch_dir)
        print(f"downloading CUDA from PyPI: {' '.join(TOOLKIT_WHEELS)} (about 530 MB)")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*pip, "--dest", str(scratch / "wheels"), *TOOLKIT_WHEELS], check=True)
        staged = scratch / "toolkit"
        for wheel in sorted((scratch / "wheels").glob("*.whl")):
            _unpack(wheel, staged)
        _lay_out(staged)
        (staged / "wheels.txt").write_text("\n".join(TOOLKIT_WHEELS) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        staged.replace(root)
    return Toolkit(root, nvcc_version(root / "bin" / "nvcc"), origin)


def _unpack(wheel: Path, into: Path) -> None:
    """The wheel's `nvidia/cu13/` tree into `into`, keeping the executables executable."""
    with zipfile.ZipFile(wheel) as archive:
        for entry in archive.infolist():
            if not entry.filename.startswith(WHEEL_ROOT) or entry.is_dir():
                continue
            target = into / entry.filename.removeprefix(WHEEL_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(entry) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            mode = entry.external_attr >> 16
            if mode:
                target.chmod(mode & 0o777)


def _lay_out(root: Path) -> None:
    """What CMake and nvcc expect of a toolkit that the wheels do not ship."""
    (root / TARGET_DIR).mkdir(parents=True)
    (root / TARGET_DIR / "include").symlink_to("../../include")
    (root / TARGET_DIR / "lib").symlink_to("../../lib")
    (root / "lib64").symlink_to("lib")
    for link, soname in SONAME_LINKS.items():
        if (root / "lib" / soname).exists():
            (root / "lib" / link).symlink_to(soname)
    _driver_stub(root / "include", root / "lib" / "stubs")


def _driver_stub(include: Path, stubs: Path) -> None:
    """`stubs/libcuda.so`, soname `libcuda.so.1`, defining every driver API entry point of
    `cuda.h`, as the toolkit's own stub does. Without the symbols the linker (`--as-needed`)
    drops it and the module misses `libcuda.so.1`: dlopen then fails on `cuDeviceGet`."""
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    header = subprocess.run(
        [cc, "-E", "-P", f"-I{include}", str(include / "cuda.h")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    names = sorted(set(re.findall(r"\bCUresult\s+(cu\w+)\s*\(", header)))
    if "cuDeviceGet" not in names:
        raise RuntimeError(f"no driver API found in {include / 'cuda.h'}")
    stubs.mkdir()
    # Never called: the node's driver provides them. 999 is CUDA_ERROR_UNKNOWN.
    (stubs / "stub.c").write_text("".join(f"int {n}(void) {{ return 999; }}\n" for n in names))
    stub = [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so")]
    subprocess.run([*stub, str(stubs / "stub.c")], check=True)
    (stubs / "stub.c").unlink()


def toolkit(cache: Path) -> Toolkit:
    """The system's toolkit where it is complete, else the PyPI one; says which."""
    found = system_toolkit() or pypi_toolkit(cache)
    print(f"CUDA {found.version} from {found.origin}: {found.nvcc}")
    return found


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def module_folder(args: list[str], kit: Toolkit, cache: Path) -> Path:
    """Where the module built with `args` by this toolkit's version is kept."""
    return cache / llama_build.build_key([*args, f"cuda-toolkit={kit.version}"])


def toolkit_args(kit: Toolkit) -> list[str]:
    return [f"-DCMAKE_CUDA_COMPILER={kit.nvcc}", f"-DCUDAToolkit_ROOT={kit.root}"]


def build_module(args: list[str], kit: Toolkit, out: Path, jobs: int) -> Path:
    """Compile only `libggml-cuda.so` (and the ggml-base it links) into `out`."""
    with tempfile.TemporaryDirectory(dir=_made(out.parent), prefix=".building-") as scratch_dir:
        scratch = Path(scratch_dir)
        print("(every CUDA kernel of ggml: about an hour per architecture on 2 cores)")
        configure = [*args, *toolkit_args(kit)]
        build = llama_build.build_vendored_target(configure, "ggml-cuda", scratch, jobs)
        staged = scratch / "out"
        staged.mkdir()
        shutil.copy2(build / "bin" / MODULE, staged / MODULE)
        llama_build.write_build_info(staged, [*args, f"cuda-toolkit={kit.version}"])
        shutil.rmtree(out, ignore_errors=True)
        staged.replace(out)
    return out / MODULE


def cached_module(args: list[str], cache: Path, jobs: int) -> Path:
    """The module built with exactly `args`, built now if not cached."""
    kit = toolkit(cache)
    module = module_folder(args, kit, cache) / MODULE
    if module.exists():
        print(f"reusing {module}")
        return module
    return build_module(args, kit, module.parent, jobs)


def install(args: list[str], cache: Path, jobs: int) -> Path:
    """Put the module into the installed llama_cpp/lib, where ggml_backends loads it."""
    lib = llama_build.installed_lib()
    return llama_build.install_module(cached_module(args, cache, jobs), lib)


def check() -> str | None:
    """None if the installed llama.cpp has the CUDA module, else what is wrong."""
    return llama_build.missing_module(MODULE, "cuda_build.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/cuda_build.py", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "build"):
        command = commands.add_parser(name, help=f"build (or reuse) the module, then {name}")
        command.add_argument("--archs", default=DEFAULT_ARCHS, help='e.g. "90" or "80;89;90"')
        command.add_argument("--extra-cmake-args", default="", help="more CMake flags")
        command.add_argument("--cache", type=Path, default=default_cache())
        command.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    commands.choices["build"].add_argument("--out", type=Path, help="copy the module here")
    commands.add_parser("toolkit").add_argument("--cache", type=Path, default=default_cache())
    commands.add_parser("check")
    args = parser.parse_args(argv)
    if args.command == "toolkit":
        print(toolkit(args.cache).root)
        return 0
    if args.command == "check":
        problem = check()
        print(problem or f"{MODULE} is installed", file=sys.stderr if problem else sys.stdout)
        return 1 if problem else 0
    flags = cuda_cmake_args(args.archs, args.extra_cmake_args)
    if args.command == "install":
        install(flags, args.cache, args.jobs)
        return 0
    module = cached_module(flags, args.cache, args.jobs)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(module, args.out / MODULE)
        module = args.out / MODULE
    print(module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
