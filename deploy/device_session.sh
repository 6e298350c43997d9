#!/usr/bin/env bash
# Baton's device benches on a lent GPU machine (#47, #51), from what `device_pack` carried.
# That machine has no package registry and no Ray; this unpacks Baton and llama.cpp's
# bindings beside its Python, compiles llama.cpp's CUDA module and the peers there (with its
# nvcc, from the carried source), generates models with a real model's widths, runs
# `baton bench device --peer` on each (llama-batched-bench, and llama-server on bench peer's
# multi-turn workload against the engine) and writes the figures under $OUT.
#
# Here, first:   python -m baton_serve.deploy.device_pack          # -> device-carry/
# There (the `run` tool, carry ["device-carry"]), in one call or two while it stays warm:
#   bash deploy/device_session.sh build     # CUDA module, llama-server, llama-batched-bench
#   bash deploy/device_session.sh bench     # models and benches; figures under $OUT
#   bash deploy/device_session.sh all
# Rehearse it here on lavapipe (Vulkan instead of CUDA, small models):
#   BATON_DEVICE=vulkan PYTHON=/path/to/python3.12 SHAPED=0 EMBD=256 LAYERS=2 CONTEXTS=256 \
#     REPEATS=1 STREAMS=1,2 CHAT="--chat-sessions 1 --chat-turns 2 --agent-sessions 1 \
#     --agent-steps 2 --system-tokens 100 --document-tokens 50 --reply-tokens 8" \
#     bash deploy/device_session.sh all
set -euo pipefail
cd "$(dirname "$0")/.."

STEP=${1:-all}
CARRY=${CARRY:-$PWD/device-carry}
OUT=${OUT:-/tmp/baton-device-out}
DEVICE=${BATON_DEVICE:-cuda}          # cuda (the lent machine) or vulkan (a rehearsal)
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/baton-site}         # Baton, its carried imports and llama_cpp
MODELS=${MODELS:-/tmp/baton-models}
JOBS=${JOBS:-$(nproc)}
CUDA_ARCHS=${CUDA_ARCHS:-90}          # H100 / H200
LAYERS=${LAYERS:-8}                   # depth of the generated models (widths: SHAPED)
SHAPED=${SHAPED:-1}                   # 1: Qwen3.5-9B and Llama-3-8B widths; 0: EMBD wide
EMBD=${EMBD:-512}
CONTEXTS=${CONTEXTS:-2048,8192}
REPEATS=${REPEATS:-3}
STREAMS=${STREAMS:-1,4,16}
THREADS=${THREADS:-$JOBS}
CHAT=${CHAT:-}                        # bench peer's workload flags for --peer (default: its own)

mkdir -p "$OUT"
log() { echo "[device_session $(date +%T)] $*" | tee -a "$OUT/session.log"; }

unpack() {
  if [ ! -d "$SITE/llama_cpp" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/wheels/*.whl
    "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$CARRY/llama_cpp.tar.xz" "$SITE"
  fi
  ln -sfn "$PWD" "$SITE/baton_serve"
  export PYTHONPATH="$SITE"
  BATON_LLAMA_SDIST=$(ls "$CARRY"/llama_cpp_python-*.tar.gz)
  export BATON_LLAMA_SDIST
}

build() {
  log "building on $JOBS cores ($DEVICE)"
  if [ "$DEVICE" = cuda ]; then
    "$PYTHON" -m baton_serve.deploy.cuda_build install --archs "$CUDA_ARCHS" --jobs "$JOBS"
  else  # the rehearsal: the Vulkan module built here (`make vulkan`), or VULKAN_MODULE's
    cp "${VULKAN_MODULE:-$(ls ~/.cache/baton/vulkan/*/libggml-vulkan.so | head -1)}" "$SITE/llama_cpp/lib/"
  fi
  log "module in place; llama-server and llama-batched-bench next"
  "$PYTHON" -m baton_serve.deploy.llama_server_build build --jobs "$JOBS"
  log "built"
}

models() {
  mkdir -p "$MODELS"
  local widths_hybrid=() widths_attention=()
  if [ "$SHAPED" = 1 ]; then
    widths_hybrid=(--shape qwen3.5-9b) widths_attention=(--shape llama-3-8b)
  else
    widths_hybrid=(--embd "$EMBD") widths_attention=(--embd "$EMBD")
  fi
  local make=("$PYTHON" -m baton_serve.deploy.cli make-model --tokenizer-from "$CARRY/tokenizer.gguf")
  [ -f "$MODELS/hybrid.gguf" ] || "${make[@]}" --arch qwen35 "${widths_hybrid[@]}" --layers "$LAYERS" --out "$MODELS/hybrid.gguf"
  [ -f "$MODELS/attention.gguf" ] || "${make[@]}" --arch llama "${widths_attention[@]}" --layers "$LAYERS" --out "$MODELS/attention.gguf"
  log "models: $(ls -l "$MODELS" | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' ')"
}

bench() {
  if [ "$DEVICE" = vulkan ]; then export GGML_VK_VISIBLE_DEVICES=0; fi
  command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/gpu.txt" 2>&1 || true
  models
  for model in hybrid attention; do
    log "bench device: $model"
    "$PYTHON" -m baton_serve.deploy.cli bench device --model "$MODELS/$model.gguf" \
      --n-gpu-layers -1 --contexts "$CONTEXTS" --repeats "$REPEATS" --streams "$STREAMS" \
      --threads "$THREADS" --prefill-chunk 2048 --peer $CHAT --out "$OUT/$model" \
      > "$OUT/$model.txt" 2> "$OUT/$model.err" || log "bench device $model failed: $(tail -3 "$OUT/$model.err")"
    tail -n 40 "$OUT/$model.txt"
  done
  log "done"
}

unpack
case "$STEP" in
  build) build ;;
  bench) bench ;;
  all) build; bench ;;
  *) echo "usage: $0 build|bench|all" >&2; exit 2 ;;
esac
