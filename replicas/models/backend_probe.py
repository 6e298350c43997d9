"""Child-process checks of llama.cpp backends (run by `replicas.engine.ggml_backends`).

`python -m baton_serve.replicas.models.backend_probe scores` prints every CPU variant's score for this CPU;
`python -m baton_serve.replicas.models.backend_probe run [--variant FILE] --repack 0|1` loads that variant and
runs a small Q4_0 model through batched and single-token decodes — the matrix kernels a
served model uses, repacked or not. If the CPU cannot run them, this process dies, not
the caller.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp

from baton_serve.replicas.engine.ggml_backends import cpu_variants, lib_dir, libggml, variant_score
from baton_serve.replicas.models.tiny_model import ModelVariant, write_tiny_model

# Large enough that llama.cpp repacks the matrices (AMX tiles, interleaved rows).
PROBE_EMBD = 256
PROBE_BATCH = 64


def scores() -> list[tuple[str, int]]:
    ranked = [(path.name, variant_score(path)) for path in cpu_variants()]
    return sorted(ranked, key=lambda item: -item[1])


def run(variant: str | None, repack: bool) -> None:
    if variant is not None:
        if not libggml.ggml_backend_load(str(lib_dir() / variant).encode()):
            raise SystemExit(f"could not load {variant}")
    llama_cpp.llama_backend_init()
    with tempfile.TemporaryDirectory() as folder:
        path = write_tiny_model(
            "llama",
            Path(folder) / "probe.gguf",
            n_embd=PROBE_EMBD,
            variant=ModelVariant(vocab="test", weights="q4_0"),
        )
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = repack
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise SystemExit("llama.cpp could not load the probe model")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = 256
        cparams.n_batch = cparams.n_ubatch = PROBE_BATCH
        cparams.n_threads = cparams.n_threads_batch = 2
        context = llama_cpp.llama_init_from_model(model, cparams)
        if not context:
            raise SystemExit("llama.cpp could not create a context")
        for tokens in (list(range(3, 3 + PROBE_BATCH)), [7]):
            array = (llama_cpp.llama_token * len(tokens))(*tokens)
            if llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(array, len(tokens))):
                raise SystemExit("llama_decode failed")
        llama_cpp.llama_free(context)
        llama_cpp.llama_model_free(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton_serve.replicas.models.backend_probe")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("scores")
    probe = commands.add_parser("run")
    probe.add_argument("--variant")
    probe.add_argument("--repack", type=int, choices=(0, 1), required=True)
    args = parser.parse_args(argv)
    if args.command == "scores":
        print(json.dumps(scores()))
    else:
        run(args.variant, bool(args.repack))
    return 0


if __name__ == "__main__":
    sys.exit(main())
