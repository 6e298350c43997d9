"""Build llama.cpp's Vulkan backend as one more loadable module beside the CPU variants.

The wheel (`llama_build`) is built with `GGML_BACKEND_DL=ON`: every backend is a module in
`llama_cpp/lib` that `replicas.engine.ggml_backends` loads at start. This builds only
`libggml-vulkan.so` from the same vendored llama.cpp (the llama-cpp-python sdist of
`llama_build.LLAMA_CPP_PYTHON_VERSION`) and copies it there. On a machine without a GPU,
Mesa's software Vulkan driver (lavapipe, Debian's `mesa-vulkan-drivers`) is the device, so
the device path runs in every test run; ggml only uses a CPU-type Vulkan device when it is
named, e.g. `GGML_VK_VISIBLE_DEVICES=0`.

The vendored backend needs Vulkan headers newer than Debian 12's (1.3.239 lacks
`VkLayerSettingEXT`): where the system's are too old, Debian's next release's
`libvulkan-dev` is fetched with apt-get (a private package list made from this machine's
own Debian sources; nothing is installed) and only its headers are used. The system's
`libvulkan.so`, `glslc` and SPIR-V headers stay Debian 12's (the Makefile installs them).

The module is kept in `~/.cache/baton/vulkan/<hash of version, flags and headers>/`.
Standard library only, like `llama_build`:
    python deploy/vulkan_build.py install [--extra-cmake-args ...]   # build or reuse, copy
    python deploy/vulkan_build.py check
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
from pathlib import Path

try:
    from . import llama_build
except ImportError:  # run as a script: python deploy/vulkan_build.py
    import llama_build  # type: ignore[no-redef]

MODULE = "libggml-vulkan.so"
VULKAN_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_VULKAN=ON",
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
# What the vendored backend needs from the headers, and where newer ones come from.
NEEDED_DECLARATION = "VkLayerSettingEXT"
HEADERS_PACKAGE = "libvulkan-dev"
HEADERS_SUITE = "trixie"
SYSTEM_INCLUDE = Path("/usr/include")


def vulkan_cmake_args(extra: str = "") -> list[str]:
    return [*VULKAN_CMAKE_ARGS, *shlex.split(extra)]


def default_cache() -> Path:
    return llama_build.default_wheel_cache().parent / "vulkan"


def header_version(include: Path) -> int | None:
    """`VK_HEADER_VERSION` of the headers under `include`, None if it has none."""
    try:
        text = (include / "vulkan" / "vulkan_core.h").read_text()
    except OSError:
        return None
    found = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
    return int(found.group(1)) if found and NEEDED_DECLARATION in text else None


def debian_sources() -> tuple[str, str | None]:
    """(archive URI, keyring) of this machine's Debian release, from its apt sources."""
    release = _os_release().get("VERSION_CODENAME", "")
    stanzas = []
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for block in path.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in block.splitlines() if re.match(r"^[\w-]+:", line)
            )
            stanzas.append({k.strip().lower(): v.strip() for k, v in fields.items()})
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*.list")]:
        for line in path.read_text().splitlines() if path.exists() else []:
            found = re.match(r"^deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)", line)
            if found:
                options = dict(o.split("=", 1) for o in (found[1] or "").split() if "=" in o)
                keyring = options.get("signed-by", "")
                stanzas.append({"uris": found[2], "suites": found[3], "signed-by": keyring})
    for stanza in stanzas:
        if release in stanza.get("suites", "").split():
            return stanza["uris"].split()[0], stanza.get("signed-by") or None
    raise RuntimeError(f"no apt source for Debian {release!r}: cannot fetch Vulkan headers")


def _os_release() -> dict[str, str]:
    lines = Path("/etc/os-release").read_text().splitlines()
    return {k: v.strip('"') for k, _, v in (ln.partition("=") for ln in lines)}


def fetched_headers(cache: Path) -> Path:
    """The include folder of Debian `HEADERS_SUITE`'s `libvulkan-dev`, fetched once."""
    folder = cache / f"headers-{HEADERS_SUITE}"
    if header_version(folder / "usr" / "include"):
        return folder / "usr" / "include"
    uri, keyring = debian_sources()
    with tempfile.TemporaryDirectory(dir=_made(cache), prefix=".apt-") as scratch_dir:
        scratch = Path(scratch_dir)
        for sub in ("lists/partial", "parts", "debs"):
            (scratch / sub).mkdir(parents=True)
        signed = f"[signed-by={keyring}] " if keyring else ""
        (scratch / "sources.list").write_text(f"deb {signed}{uri} {HEADERS_SUITE} main\n")
        apt = [
            "apt-get",
            "-qq",
            f"-o=Dir::Etc::SourceList={scratch / 'sources.list'}",
            f"-o=Dir::Etc::SourceParts={scratch / 'parts'}",
            f"-o=Dir::State::Lists={scratch / 'lists'}",
            f"-o=Dir::Cache={scratch / 'cache'}",
            # As root, apt's download user cannot write into this private folder.
            *(["-o=APT::Sandbox::User=root"] if os.geteuid() == 0 else []),
        ]
        print(f"fetching {HEADERS_PACKAGE} from Debian {HEADERS_SUITE} for its Vulkan headers")
        subprocess.run([*apt, "update"], check=True)
        subprocess.run([*apt, "download", HEADERS_PACKAGE], cwd=scratch / "debs", check=True)
        (deb,) = (scratch / "debs").glob(f"{HEADERS_PACKAGE}_*.deb")
        staged = scratch / "headers"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staged)], check=True)
        (staged / "package.txt").write_text(deb.name + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staged.replace(folder)
    return folder / "usr" / "include"


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def headers(cache: Path) -> tuple[Path | None, str]:
    """(include folder to build with, None for the system's; a label for the cache key)."""
    system = header_version(SYSTEM_INCLUDE)
    if system is not None:
        return None, f"system-{system}"
    include = fetched_headers(cache)
    package = (include.parent.parent / "package.txt").read_text().strip()
    return include, package


def build_module(args: list[str], include: Path | None, out: Path, jobs: int) -> Path:
    """Compile only `libggml-vulkan.so` (and the ggml-base it links) into `out`."""
    with tempfile.TemporaryDirectory(dir=_made(out.parent), prefix=".building-") as scratch_dir:
        scratch = Path(scratch_dir)
        configure = [*args, *([f"-DVulkan_INCLUDE_DIR={include}"] if include else [])]
        print("(the Vulkan backend and its shaders: about 4-6 minutes on 2 cores)")
        build = llama_build.build_vendored_target(configure, "ggml-vulkan", scratch, jobs)
        staged = scratch / "out"
        staged.mkdir()
        shutil.copy2(build / "bin" / MODULE, staged / MODULE)
        llama_build.write_build_info(staged, configure)
        shutil.rmtree(out, ignore_errors=True)
        staged.replace(out)
    return out / MODULE


def cached_module(args: list[str], cache: Path, jobs: int) -> Path:
    """The module built with exactly `args` and these headers, built now if not cached."""
    include, label = headers(cache)
    folder = cache / llama_build.build_key([*args, f"vulkan-headers={label}"])
    module = folder / MODULE
    if module.exists():
        print(f"reusing {module}")
        return module
    return build_module(args, include, folder, jobs)


def install(args: list[str], cache: Path, jobs: int) -> Path:
    """Put the module into the installed llama_cpp/lib, where ggml_backends loads it."""
    lib = llama_build.installed_lib()
    return llama_build.install_module(cached_module(args, cache, jobs), lib)


def check() -> str | None:
    """None if the installed llama.cpp has the Vulkan module, else what is wrong."""
    return llama_build.missing_module(MODULE, "vulkan_build.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/vulkan_build.py", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("install", help="build (or reuse) the module and install it")
    build.add_argument("--extra-cmake-args", default="", help="more CMake flags")
    build.add_argument("--cache", type=Path, default=default_cache())
    build.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    commands.add_parser("check")
    args = parser.parse_args(argv)
    if args.command == "check":
        problem = check()
        print(problem or f"{MODULE} is installed", file=sys.stderr if problem else sys.stdout)
        return 1 if problem else 0
    install(vulkan_cmake_args(args.extra_cmake_args), args.cache, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
