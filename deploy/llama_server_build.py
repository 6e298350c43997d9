"""Build `llama-server` and `llama-batched-bench` from the llama.cpp that llama-cpp-python
vendors, the portable way.

`baton bench peer` compares Baton with llama-server on the same llama.cpp, and `baton bench
device --peer` its engine with `llama-batched-bench`: they are
compiled from the `vendor/llama.cpp` of the llama-cpp-python sdist Baton installs
(`llama_build.LLAMA_CPP_PYTHON_VERSION`), with the wheel's portable flags (`GGML_NATIVE=OFF`,
`GGML_BACKEND_DL=ON`; never native, see `llama_build`). Its CPU kernels are not compiled a
second time (`GGML_CPU=OFF`, which leaves the 14 variant modules out: about 40 of the 60
minutes on 2 cores): ggml loads CPU backends at run time from the binary's folder or the
working directory, and `loadtests/llama_server.py` starts it in a directory that links the very
module of the installed wheel that Baton's engine loads (`replicas.engine.ggml_backends`), so
both run identical kernels.

The result is kept in `~/.cache/baton/llama-server/<hash of version, flags and binaries>/`
(binaries and shared libraries side by side; they find the libraries through `$ORIGIN`).

Standard library only, like `llama_build`:
    python deploy/llama_server_build.py build [--extra-cmake-args ...]   # prints the server's path
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

try:
    from . import llama_build
except ImportError:  # run as a script: python deploy/llama_server_build.py
    import llama_build  # type: ignore[no-redef]

SERVER_CMAKE_ARGS = (
    # The CPU backend comes from the installed wheel (see the module's docstring).
    "-DGGML_CPU=OFF",
    "-DGGML_CPU_ALL_VARIANTS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    # Libraries are found beside the binary wherever the folder is moved to.
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    # No web UI: nothing is fetched from the network at build time.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
SERVER_BINARY = "llama-server"
BATCHED_BENCH_BINARY = "llama-batched-bench"
BINARIES = (SERVER_BINARY, BATCHED_BENCH_BINARY)


def server_cmake_args(extra: str = "") -> list[str]:
    """The wheel's portable flags, then the server build's own (a later -D wins)."""
    return [*llama_build.cmake_args(extra), *SERVER_CMAKE_ARGS]


def default_server_cache() -> Path:
    return llama_build.default_wheel_cache().parent / "llama-server"


def cached_server_dir(args: list[str], cache: Path) -> Path:
    return cache / llama_build.build_key([*args, *BINARIES])


def build_server(args: list[str], out: Path, jobs: int) -> Path:
    """Compile llama-server and llama-batched-bench with `args` into `out`; returns the
    server's path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".building-") as scratch_dir:
        scratch = Path(scratch_dir)
        print("(llama.cpp without its CPU kernels: about 15-20 minutes on 2 shared cores)")
        build = llama_build.build_vendored_target(args, BINARIES, scratch, jobs)
        staged = scratch / "out"
        staged.mkdir()
        for path in (build / "bin").iterdir():
            if path.name in BINARIES or ".so" in path.name:
                shutil.copy2(path, staged / path.name, follow_symlinks=False)
        llama_build.write_build_info(staged, args)
        try:
            staged.replace(out)
        except OSError:
            if not (out / SERVER_BINARY).exists():
                raise
            # another process built the same flags meanwhile: its build is used
    return out / SERVER_BINARY


def cached_server(args: list[str] | None = None, cache: Path | None = None, jobs: int = 2) -> Path:
    """The llama-server built with exactly `args` (llama-batched-bench beside it), built now
    if the cache has none."""
    args = server_cmake_args() if args is None else args
    folder = cached_server_dir(args, cache or default_server_cache())
    binary = folder / SERVER_BINARY
    if binary.exists():
        return binary
    return build_server(args, folder, jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python deploy/llama_server_build.py", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build (or reuse) llama-server; prints its path")
    build.add_argument(
        "--extra-cmake-args",
        default=os.environ.get("LLAMA_CMAKE_ARGS", ""),
        help="more CMake flags (default: $LLAMA_CMAKE_ARGS)",
    )
    build.add_argument("--cache", type=Path, default=default_server_cache())
    build.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    print(cached_server(server_cmake_args(args.extra_cmake_args), args.cache, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
