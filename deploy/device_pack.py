"""Pack what a lent GPU machine needs for Baton's device benches (`deploy/device_session.sh`).

That machine reaches no package registry, has no Ray, and takes at most 64 MiB of files
(the repository included). Into `device-carry/` (ignored by git) this writes:

- `llama_cpp.tar.xz`: the installed llama-cpp-python package (bindings and libraries) with
  the CPU variants a datacentre x86-64 host runs (`KEPT_CPU_VARIANTS`), each library once
  (its other names as links), and no GPU module: the session compiles CUDA's there, with
  the machine's own nvcc, from the source below.
- `llama_cpp_python-<version>.tar.gz`: the pinned sdist cut to what builds llama.cpp (no
  models, docs, tests or examples), read through `$BATON_LLAMA_SDIST` by the CUDA module's
  and the peers' (llama-server, llama-batched-bench) builds.
- `wheels/`: CPython 3.12 wheels of what Baton imports that the machine's image lacks.
- `tokenizer.gguf`: SmolLM2's tokenizer alone, for the models generated there.

    python -m baton_serve.deploy.device_pack [--out device-carry]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from baton_serve.deploy import llama_build
from baton_serve.replicas.models.tiny_model import write_tokenizer

CARRY_LIMIT_BYTES = 64 << 20  # what travels to the lent machine, the repository included
KEPT_CPU_VARIANTS = ("x64", "haswell", "skylakex", "icelake", "sapphirerapids", "zen4")
# Baton's imports the GPU machine's image (Python 3.12, PyTorch's stack) does not have, at
# the versions installed here.
WHEELS = (
    "annotated-types",
    "cffi",  # miniaudio's and cryptography's compiled modules
    "cryptography",  # state blobs are sealed with AES-GCM
    "diskcache",
    "gguf",
    "httpx-sse",  # the peers' streamed replies
    "importlib-metadata",
    "miniaudio",
    "opentelemetry-api",
    "pydantic",
    "pydantic-core",
    "starlette",  # the gateway's bounds, which the config names
    "typing-inspection",
    "zstandard",
)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Parts of the vendored llama.cpp no build of Baton's needs (tests, examples and the server's
# web UI are switched off in every configuration it builds).
SOURCE_SKIPPED = ("models", "docs", "tests", "examples", "benches", "media", "gguf-py", ".git")


def pack_llama_cpp(package: Path, out: Path) -> Path:
    """The installed `llama_cpp` package as `out`/llama_cpp.tar.xz (see the module doc)."""
    archive = out / "llama_cpp.tar.xz"
    seen: dict[str, str] = {}  # a library's digest -> its first name
    with tarfile.open(archive, "w:xz") as tar:
        for path in sorted(package.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file() or _left_out(path.name):
                continue
            name = str(Path("llama_cpp") / path.relative_to(package))
            if path.suffix == ".so" or ".so." in path.name:
                key = hashlib.sha256(path.read_bytes()).hexdigest()
                if key in seen:  # libllama.so.0.5.0 and its two names: one copy, two links
                    link = tarfile.TarInfo(name)
                    link.type, link.linkname = tarfile.SYMTYPE, Path(seen[key]).name
                    tar.addfile(link)
                    continue
                seen[key] = name
            tar.add(path, arcname=name)
    return archive


def _left_out(name: str) -> bool:
    if name.startswith("libggml-cpu-"):
        return name.removeprefix("libggml-cpu-").removesuffix(".so") not in KEPT_CPU_VARIANTS
    return name.startswith(("libggml-vulkan", "libggml-cuda"))


def pack_source(sdist: Path, out: Path) -> Path:
    """The sdist without what no build needs, under the sdist's own name."""
    trimmed = out / sdist.name
    with tarfile.open(sdist) as full, tarfile.open(trimmed, "w:gz", compresslevel=9) as tar:
        for member in full.getmembers():
            parts = member.name.split("/")
            vendored = parts[1:3] == ["vendor", "llama.cpp"]
            if parts[1:2] == [".git"] or (
                vendored and len(parts) > 3 and parts[3] in SOURCE_SKIPPED
            ):
                continue
            data = full.extractfile(member) if member.isfile() else None
            tar.addfile(member, io.BytesIO(data.read()) if data else None)
    return trimmed


def download_wheels(out: Path) -> Path:
    """`WHEELS` for CPython 3.12 on x86-64 Linux, without their dependencies."""
    folder = out / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    pinned = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    subprocess.run([*command, *platforms, "--dest", str(folder), *pinned], check=True)
    return folder


def carried_bytes(paths: list[Path]) -> int:
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton_serve.deploy.device_pack", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=Path("device-carry"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    package = llama_build.installed_lib().parent
    with tempfile.TemporaryDirectory() as scratch:
        sdist = llama_build.download_sdist(Path(scratch))
        packed = [
            pack_llama_cpp(package, args.out),
            pack_source(sdist, args.out),
            download_wheels(args.out),
            write_tokenizer(args.out / "tokenizer.gguf"),
        ]
    repository = carried_bytes([Path(p) for p in _tracked_files()])
    total = carried_bytes(packed) + repository
    for path in packed:
        print(f"{carried_bytes([path]) / 2**20:7.1f} MiB  {path}")
    print(f"{total / 2**20:7.1f} MiB with the repository ({CARRY_LIMIT_BYTES >> 20} MiB travel)")
    if total > CARRY_LIMIT_BYTES:
        print("too much to travel to the device machine", file=sys.stderr)
        return 1
    return 0


def _tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.splitlines() if Path(name).is_file()]


if __name__ == "__main__":
    sys.exit(main())
