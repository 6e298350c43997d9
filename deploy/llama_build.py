"""Build llama-cpp-python the portable way, and check that the installed one is.

llama.cpp's default build (`GGML_NATIVE=ON`) compiles its CPU code for the build machine:
on a VM whose CPU advertises instructions the VM does not let a process run (AMX here),
or on any older node, it dies with SIGILL. Baton builds it as llama.cpp's own releases do:
`GGML_NATIVE=OFF`, every CPU variant as a loadable backend module
(`GGML_BACKEND_DL=ON`, `GGML_CPU_ALL_VARIANTS=ON`), installed beside `libllama.so`;
`replicas.engine.ggml_backends` picks, at start, the best variant this machine really runs.

pip caches a built wheel by version only, not by `CMAKE_ARGS`, so a machine that once built
a native wheel would silently reinstall it. Wheels are therefore built with pip's cache off
and kept in a directory named after the version and the flags
(`~/.cache/baton/wheels/llama-cpp-python-0.3.36-<hash of the flags>/`).

Standard library only: it runs before the project is installed.
    python deploy/llama_build.py install [--extra-cmake-args "-DGGML_CUDA=on"]
    python deploy/llama_build.py wheel --out DIR [--extra-cmake-args ...]
    python deploy/llama_build.py check
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
PORTABLE_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CPU_ALL_VARIANTS=ON",
    # Backend modules install into CMAKE_INSTALL_BINDIR: put them beside libllama.so.
    "-DCMAKE_INSTALL_BINDIR=llama_cpp/lib",
    # libmtmd (llama.cpp's multimodal library) is built: Baton encodes images with it.
    "-DLLAVA_BUILD=ON",
)
BUILD_INFO = "baton-build.json"
SDIST_ENV = "BATON_LLAMA_SDIST"  # a local llama-cpp-python sdist, instead of pip's download


def cmake_args(extra: str = "") -> list[str]:
    return [*PORTABLE_CMAKE_ARGS, *shlex.split(extra)]


def build_key(args: list[str]) -> str:
    """What decides whether a built wheel can be reused: the version and every flag."""
    text = json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, "cmake_args": args})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def download_sdist(into: Path) -> Path:
    """The llama-cpp-python sdist of the pinned version: `$BATON_LLAMA_SDIST` where a machine
    with no package registry was given one (`device_pack` carries a trimmed one), else
    fetched with pip."""
    given = os.environ.get(SDIST_ENV)
    if given:
        return Path(given)
    version = LLAMA_CPP_PYTHON_VERSION
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--dest",
            str(into),
            f"llama-cpp-python=={version}",
        ],
        check=True,
    )
    (sdist,) = into.glob(f"llama_cpp_python-{version}.tar.gz")
    return sdist


def vendored_source(sdist: Path, into: Path) -> Path:
    """The llama.cpp source the sdist vendors, unpacked into `into`."""
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    (source,) = into.glob("llama_cpp_python-*/vendor/llama.cpp")
    return source


def build_vendored_target(
    args: list[str], target: str | Sequence[str], scratch: Path, jobs: int
) -> Path:
    """The pinned sdist's vendored llama.cpp, unpacked in `scratch`, configured with `args`
    and only `target` (or each of several) built (niced: it shares the machine); returns the
    build folder."""
    targets = [target] if isinstance(target, str) else list(target)
    source = vendored_source(download_sdist(scratch), scratch / "src")
    build = scratch / "build"
    print(f"building {', '.join(targets)} from {source} with {' '.join(args)}")
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *args], check=True)
    subprocess.run(
        [*nice, "cmake", "--build", str(build), "-j", str(jobs), "--target", *targets], check=True
    )
    return build


def write_build_info(folder: Path, args: list[str]) -> None:
    """Record the version and flags a build in `folder` was made with."""
    info = {"version": LLAMA_CPP_PYTHON_VERSION, "cmake_args": args}
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


def default_wheel_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "baton" / "wheels"


def build_wheel(args: list[str], out: Path) -> Path:
    """Compile llama-cpp-python with `args` into `out` (pip's own cache bypassed)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".building-") as scratch:
        env = {**os.environ, "CMAKE_ARGS": " ".join(args)}
        print(f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with {' '.join(args)}")
        print("(compiles llama.cpp with every CPU variant: 10-20 minutes on 2 cores)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-cache-dir",
                "--no-binary",
                "llama-cpp-python",
                "--wheel-dir",
                scratch,
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            ],
            env=env,
            check=True,
        )
        (wheel,) = Path(scratch).glob("llama_cpp_python-*.whl")
        target = out / wheel.name
        wheel.replace(target)
    (out / BUILD_INFO).write_text(
        json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, "cmake_args": args}, indent=2) + "\n"
    )
    return target


def cached_wheel(args: list[str], cache: Path) -> Path:
    """The wheel built with exactly `args`, built now if the cache has none."""
    folder = cache / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-{build_key(args)}"
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if wheels:
        print(f"reusing {wheels[0]} (built with {' '.join(args)})")
        return wheels[0]
    return build_wheel(args, folder)


def install(args: list[str], cache: Path) -> None:
    wheel = cached_wheel(args, cache)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)],
        check=True,
    )


def installed_lib_dir() -> Path | None:
    """`llama_cpp/lib` of the installed package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "lib"


def installed_lib() -> Path:
    """`installed_lib_dir()`, or a RuntimeError saying how to install llama-cpp-python."""
    lib = installed_lib_dir()
    if lib is None or not lib.is_dir():
        raise RuntimeError("llama-cpp-python is not installed: run `make install` first")
    return lib


def install_module(module: Path, lib: Path) -> Path:
    """Copy a backend module (CUDA's, Vulkan's) into `lib`, beside the CPU variants, where
    `ggml_backends` loads every module; a copy already there and equal is left as it is."""
    target = lib / module.name
    if not (target.exists() and filecmp.cmp(module, target, shallow=False)):
        shutil.copy2(module, target)
    print(f"installed {target}")
    return target


def missing_module(name: str, script: str) -> str | None:
    """None if the installed llama.cpp has the module `name`, else how to install it."""
    lib = installed_lib_dir()
    if lib is None or not (lib / name).exists():
        return f"no {name} beside llama.cpp: run `python deploy/{script} install`"
    return None


def check() -> str | None:
    """None if the installed llama.cpp is the portable build, else what is wrong."""
    lib = installed_lib_dir()
    if lib is None:
        return "llama-cpp-python is not installed"
    variants = sorted(p.name for p in lib.glob("libggml-cpu-*.so"))
    if not variants:
        return (
            f"{lib} has no CPU backend variants (libggml-cpu-*.so): this llama-cpp-python "
            "was built for one machine (GGML_NATIVE) and can die with SIGILL on another. "
            "Reinstall it with `python deploy/llama_build.py install` (or `make install`)."
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/llama_build.py", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "wheel"):
        command = commands.add_parser(name)
        command.add_argument(
            "--extra-cmake-args",
            default=os.environ.get("LLAMA_CMAKE_ARGS", ""),
            help='more CMake flags, e.g. "-DGGML_CUDA=on" (default: $LLAMA_CMAKE_ARGS)',
        )
        command.add_argument("--wheel-cache", type=Path, default=default_wheel_cache())
    commands.choices["wheel"].add_argument("--out", type=Path, required=True)
    commands.add_parser("check")
    args = parser.parse_args(argv)
    if args.command == "check":
        problem = check()
        if problem:
            print(f"llama_build: {problem}", file=sys.stderr)
            return 1
        print(f"llama-cpp-python is the portable build ({installed_lib_dir()})")
        return 0
    flags = cmake_args(args.extra_cmake_args)
    if args.command == "install":
        install(flags, args.wheel_cache)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cached_wheel(flags, args.wheel_cache), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
