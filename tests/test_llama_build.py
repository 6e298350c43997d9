"""The installed llama.cpp is the portable build, and the CPU backend in use was tested here.

`make install` builds llama-cpp-python with every CPU variant as a loadable module
(`deploy/llama_build.py`); `replicas.engine.ggml_backends` picks the best variant this
machine runs, after a child process showed it does.
"""

from __future__ import annotations

import subprocess
import sys

from baton_serve.deploy import llama_build
from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.models.model_check import ModelCheckFailed, check_model
from baton_serve.replicas.models.tiny_model import ModelVariant, write_tiny_model


def test_the_installed_llama_cpp_is_the_portable_build() -> None:
    assert llama_build.check() is None, llama_build.check()
    names = {path.name for path in ggml_backends.cpu_variants()}
    assert {"libggml-cpu-x64.so", "libggml-cpu-haswell.so"} <= names


def test_wheels_are_reused_only_for_the_same_flags() -> None:
    portable = llama_build.cmake_args()
    cuda = llama_build.cmake_args("-DGGML_CUDA=on")
    assert "-DGGML_NATIVE=OFF" in portable and cuda[-1] == "-DGGML_CUDA=on"
    assert llama_build.build_key(portable) == llama_build.build_key(list(portable))
    assert llama_build.build_key(portable) != llama_build.build_key(cuda)


def test_the_loaded_cpu_backend_passed_its_test_and_reports_its_features() -> None:
    choice = ggml_backends.ensure_loaded()
    assert choice.variant in {path.name for path in ggml_backends.cpu_variants()}
    assert choice == ggml_backends.cpu_choice()  # cached per machine
    info = ggml_backends.system_info()
    assert "CPU :" in info, info
    # The probe itself runs in a child process and survives on this machine.
    probe = [
        sys.executable,
        "-m",
        "baton_serve.replicas.models.backend_probe",
        "run",
        "--variant",
        choice.variant,
    ]
    done = subprocess.run([*probe, "--repack", str(int(choice.repack_safe))], timeout=120)
    assert done.returncode == 0


def test_a_model_llama_cpp_cannot_load_fails_the_check_with_its_cause(tmp_path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    try:
        check_model(broken)
    except ModelCheckFailed as exc:
        assert "broken.gguf" in str(exc) and "exit code" in str(exc)
    else:
        raise AssertionError("a broken GGUF passed the model check")


def test_the_model_check_reports_missing_metadata(tmp_path) -> None:
    path = write_tiny_model(
        "qwen35", tmp_path / "bare.gguf", variant=ModelVariant(vocab="test", bos=False, eos=False)
    )
    report = check_model(path)
    assert (report.kind, report.has_bos, report.has_eos) == ("hybrid", False, False)
    assert "no BOS" in report.summary() and report.cpu_backend in report.summary()
