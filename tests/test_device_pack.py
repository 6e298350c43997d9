"""What `device_pack` carries to a lent GPU machine, and llama-batched-bench's command line.

The packing rules run on small folders and archives laid out as the installed package and
the sdist are (the real ones are 70 MB of libraries and a 76 MB download); the session
script that unpacks them was rehearsed on the Vulkan device (docs/benchmarks.md).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from baton_serve.deploy.device_pack import pack_llama_cpp, pack_source
from baton_serve.loadtests.batched_bench import (
    BatchedBenchSettings,
    batched_bench_command,
    parse_rows,
)


def _package(root: Path) -> Path:
    lib = root / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (root / "llama_cpp" / "llama_cpp.py").write_text("# bindings\n")
    for name in ("libllama.so", "libllama.so.0", "libllama.so.0.5.0"):
        (lib / name).write_bytes(b"llama" * 100)  # the wheel's three copies of one library
    for variant in ("x64", "sandybridge", "sapphirerapids"):
        (lib / f"libggml-cpu-{variant}.so").write_bytes(variant.encode() * 50)
    (lib / "libggml-vulkan.so").write_bytes(b"vulkan")
    return root / "llama_cpp"


def test_the_package_travels_once_each_without_gpu_modules_or_old_cpu_variants(
    tmp_path: Path,
) -> None:
    archive = pack_llama_cpp(_package(tmp_path / "site"), tmp_path)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
    lib = "llama_cpp/lib/"
    assert set(members) == {
        "llama_cpp/llama_cpp.py",
        lib + "libllama.so",
        lib + "libllama.so.0",
        lib + "libllama.so.0.5.0",
        lib + "libggml-cpu-x64.so",
        lib + "libggml-cpu-sapphirerapids.so",
    }
    assert members[lib + "libllama.so"].isfile()
    for name in ("libllama.so.0", "libllama.so.0.5.0"):
        assert members[lib + name].issym() and members[lib + name].linkname == "libllama.so"


def _sdist(path: Path) -> Path:
    files = {
        "llama_cpp_python-0.3.36/pyproject.toml": b"[project]\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt": b"project(llama)\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml.c": b"int x;\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server.cpp": b"int y;\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama.gguf": b"0" * 1000,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/docs/build.md": b"# build\n",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/tests/test-rope.cpp": b"int z;\n",
        "llama_cpp_python-0.3.36/.git/HEAD": b"ref\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_source_travels_without_models_docs_tests_or_history(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    trimmed = pack_source(_sdist(tmp_path / "llama_cpp_python-0.3.36.tar.gz"), tmp_path / "out")
    assert trimmed.name == "llama_cpp_python-0.3.36.tar.gz"  # what the builds look for
    with tarfile.open(trimmed) as tar:
        names = {m.name.removeprefix("llama_cpp_python-0.3.36/") for m in tar.getmembers()}
        source = tar.extractfile("llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml.c")
        assert source is not None and source.read() == b"int x;\n"
    assert names == {
        "pyproject.toml",
        "vendor/llama.cpp/CMakeLists.txt",
        "vendor/llama.cpp/ggml/src/ggml.c",
        "vendor/llama.cpp/tools/server/server.cpp",
    }


def test_llama_batched_bench_runs_with_the_engines_offload_and_attention() -> None:
    settings = BatchedBenchSettings(threads=16, n_gpu_layers=-1, flash_attn=None)
    command = batched_bench_command(
        Path("llama-batched-bench"),
        Path("m.gguf"),
        settings,
        prompts=(32,),
        generated=64,
        parallel=(1, 4, 16),
    )
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["-ngl"] == "all"  # Baton's -1 is every layer; llama.cpp's -1 is its "auto"
    assert flags["-fa"] == "auto" and flags["-t"] == "16"
    assert flags["-npl"] == "1,4,16" and flags["-c"] == str(16 * (32 + 64))
    off = BatchedBenchSettings(threads=2, n_gpu_layers=0, flash_attn=False)
    command = batched_bench_command(
        Path("b"), Path("m.gguf"), off, prompts=(100,), generated=1, parallel=(1,)
    )
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["-ngl"] == "0" and flags["-fa"] == "off"


def test_a_batched_bench_run_without_results_is_an_error() -> None:
    assert parse_rows('main: n_kv_max = 96\n{"pl": 1, "speed_tg": 9.5}\n') == [
        {"pl": 1, "speed_tg": 9.5}
    ]
    with pytest.raises(RuntimeError, match="printed no results"):
        parse_rows("error: failed to load model\n")
