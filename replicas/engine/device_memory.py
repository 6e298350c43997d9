"""Device memory is budgeted: what an engine config needs on its GPU, measured before it loads.

llama.cpp measures it, as its own `--fit` does (common/fit.cpp): the model and a context
with the engine's exact parameters are created with `no_alloc` (metadata only, every
allocation simulated), and llama.cpp's log of that dry run says which layers went to which
device, each KV and recurrent cache's size and the compute buffer it reserved per device.
The weights on a device are the GGUF byte sizes of the tensors of the layers llama.cpp
assigned to it (a dry run logs no weight sizes). The sum must fit the replica's budget on
that device (`budget_bytes`), or the config is refused with the numbers before anything is
allocated. Checkpoints never count: a sequence state is copied to host memory
(`llama_state_seq_get_data`) and kept in RAM or on disk, never on the device.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp

from baton_serve.replicas.engine import ggml_backends, llama_model
from baton_serve.replicas.engine.engine_config import EngineConfig, context_size
from baton_serve.replicas.engine.llama_context import ContextParams, context_params

logger = logging.getLogger("baton.device_memory")

MIB = 1 << 20
HEADROOM = 0.05  # of a budget, left to the driver and to fragmentation
_GGML_LOG_LEVEL_WARN = 3

_LAYER_DEVICE = re.compile(r"load_tensors: layer\s+(\d+) assigned to device (\S+?),")
_CACHE_LAYER = re.compile(r"^(llama_kv_cache|llama_memory_recurrent)[:,] layer\s+\d+: dev = (\S+)")
_CACHE_SIZE = re.compile(r"^(llama_kv_cache|llama_memory_recurrent): size =\s*([\d.]+) MiB")
_COMPUTE = re.compile(r"^\w+:\s+(\S+) compute buffer size =\s*([\d.]+) MiB")
_BLOCK = re.compile(r"^blk\.(\d+)\.")

_dry_run_lock = threading.Lock()


class DeviceMemoryError(llama_model.ModelLoadError):
    """The config needs more device memory than the replica's budget; the message has the
    numbers and what to lower."""


@dataclass(frozen=True)
class DeviceNeed:
    """Bytes one config needs on one device, and what that device has."""

    device: str  # ggml's device name, e.g. "Vulkan0", "CUDA0"
    n_ctx: int  # the context per slot measured (n_ctx 0 or too large resolved)
    weights: int
    kv_cache: int
    recurrent: int
    compute: int
    free: int
    total: int

    @property
    def needed(self) -> int:
        return self.weights + self.kv_cache + self.recurrent + self.compute


def engine_context_params(config: EngineConfig, n_ctx_train: int) -> ContextParams:
    """The context an engine with `config` creates for a model trained on `n_ctx_train`."""
    return ContextParams(
        n_ctx_per_seq=context_size(config.n_ctx, n_ctx_train),
        n_seqs=config.n_slots,
        n_batch=config.n_batch,
        n_threads=config.n_threads,
        flash_attn=config.flash_attn,
        node_cores=config.node_cores,
    )


def ray_gpu_share() -> float:
    """The fraction of a GPU Ray assigned this replica (`num_gpus_per_replica` < 1), else 1."""
    ray = sys.modules.get("ray")  # never imported here: a process without Ray has no share
    if ray is None or not ray.is_initialized():
        return 1.0
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:  # the driver: nothing is assigned to it
        return 1.0
    share = float(context.get_assigned_resources().get("GPU", 0.0))
    return share if 0 < share < 1 else 1.0


def budget_bytes(free: int, total: int, share: float) -> int:
    """What a replica may use of a device: its share of the device's memory, never more
    than is free now (replicas sharing a GPU start one after another), less HEADROOM."""
    return int(min(free, total * share) * (1 - HEADROOM))


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of ggml device `device`, as its backend reports them."""
    lib = ggml_backends.libggml
    lib.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_dev_memory.restype = None
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    handle = lib.ggml_backend_dev_by_name(device.encode())
    if not handle:
        raise ValueError(f"ggml has no device {device!r}")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def offloads(config: EngineConfig) -> bool:
    """Whether an engine with `config` computes on a GPU: layers offloaded, a device
    llama.cpp can use, and the compute not emulated."""
    if config.n_gpu_layers == 0 or config.emulated is not None:
        return False
    return bool(ggml_backends.offload_devices())


def check_fits(
    path: str | Path, config: EngineConfig, *, share: float | None = None
) -> list[DeviceNeed]:
    """Measure what `config` needs on each device and raise `DeviceMemoryError` where it
    exceeds the budget (`share`: the replica's fraction of each device, default Ray's
    assignment). Nothing is measured for a CPU-only or emulated config, or where llama.cpp
    has no GPU."""
    if not offloads(config):
        return []
    needs = measure(path, config)
    share = ray_gpu_share() if share is None else share
    for need in needs:
        budget = budget_bytes(need.free, need.total, share)
        if need.needed > budget:
            raise DeviceMemoryError(_refusal(need, config, share, budget))
        logger.info(
            "%s needs %.1f of %.1f MiB budgeted on %s",
            Path(path).name,
            need.needed / MIB,
            budget / MIB,
            need.device,
        )
    return needs


def measure(path: str | Path, config: EngineConfig) -> list[DeviceNeed]:
    """What `config` needs on each GPU device, from a llama.cpp dry run (see the module)."""
    lines, n_ctx = _dry_run(str(path), config)
    layer_device = {int(m[1]): m[2] for ln in lines if (m := _LAYER_DEVICE.search(ln))}
    weights = _weights_by_device(Path(path), layer_device)
    caches: dict[str, Counter[str]] = {
        "llama_kv_cache": Counter(),
        "llama_memory_recurrent": Counter(),
    }
    pending: dict[str, list[str]] = defaultdict(list)
    compute: Counter[str] = Counter()
    for line in lines:
        if m := _CACHE_LAYER.match(line):
            pending[m[1]].append(m[2])
        elif m := _CACHE_SIZE.match(line):  # spread over the layers listed since the last
            devices = pending.pop(m[1], [])
            for device, n in Counter(devices).items():
                caches[m[1]][device] += int(float(m[2]) * MIB * n / len(devices))
        elif m := _COMPUTE.match(line):
            compute[m[1]] += int(float(m[2]) * MIB)
    gpus = [name.split(":")[0] for name in ggml_backends.offload_devices()]
    needs = []
    for device in gpus:
        if device not in layer_device.values():
            continue
        free, total = device_memory(device)
        needs.append(
            DeviceNeed(
                device=device,
                n_ctx=n_ctx,
                weights=weights[device],
                kv_cache=caches["llama_kv_cache"][device],
                recurrent=caches["llama_memory_recurrent"][device],
                compute=compute[device],
                free=free,
                total=total,
            )
        )
    return needs


def _dry_run(path: str, config: EngineConfig) -> tuple[list[str], int]:
    """llama.cpp's log of loading `path` and creating the engine's context with no_alloc,
    and the context per slot that was measured."""
    backend = llama_model._init_backend()
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", errors="replace")
        lines.append(line)
        if level >= _GGML_LOG_LEVEL_WARN and line.strip():
            logger.warning("llama.cpp (measuring): %s", line.rstrip())

    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = config.n_gpu_layers
    mparams.use_extra_bufts = (
        backend.repack_safe if config.cpu_repack is None else config.cpu_repack
    )
    mparams.no_alloc = True
    mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # a dry run maps nothing
    previous, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    with _dry_run_lock:  # llama.cpp's logger is one per process
        llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(user_data))
        llama_cpp.llama_log_set(capture, None)
        try:
            model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
            if not model:
                raise llama_model.ModelLoadError(f"llama.cpp could not read {path}")
            try:
                params = engine_context_params(config, llama_cpp.llama_model_n_ctx_train(model))
                context = llama_cpp.llama_init_from_model(model, context_params(params))
                if not context:
                    raise llama_model.ModelLoadError(
                        f"llama.cpp could not plan a context for {path}: n_ctx {params.n_ctx_per_seq}"
                        f", n_slots {params.n_seqs}, n_batch {params.n_batch}"
                    )
                llama_cpp.llama_free(context)
            finally:
                llama_cpp.llama_model_free(model)
        finally:
            llama_cpp.llama_log_set(previous, user_data)
    return "".join(lines).splitlines(), params.n_ctx_per_seq


def _weights_by_device(path: Path, layer_device: dict[int, str]) -> Counter[str]:
    """GGUF bytes of the tensors on each device: a block's tensors where llama.cpp put its
    layer; the output layer's (index n_layer) with it, the token embeddings duplicated there
    where the model has no output matrix; the input layer (token embeddings) on the CPU."""
    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    output_layer = max(layer_device, default=-1)
    if "output.weight" not in sizes and "token_embd.weight" in sizes:
        sizes["output.weight"] = sizes["token_embd.weight"]
    found: Counter[str] = Counter()
    for name, size in sizes.items():
        if m := _BLOCK.match(name):
            layer = int(m[1])
        elif name.startswith(("output.", "output_norm.")):
            layer = output_layer
        else:
            continue
        found[layer_device.get(layer, "CPU")] += size
    return found


def _refusal(need: DeviceNeed, config: EngineConfig, share: float, budget: int) -> str:
    def mib(n: int) -> str:
        return f"{n / MIB:.1f} MiB"

    shared = f"{share:g} of the device (Ray's num_gpus_per_replica), " if share < 1 else ""
    return (
        f"the engine config does not fit {need.device}: n_gpu_layers={config.n_gpu_layers}, "
        f"n_ctx={need.n_ctx} per slot, n_slots={config.n_slots}, n_batch={config.n_batch} "
        f"need {mib(need.needed)} = weights {mib(need.weights)} + KV cache "
        f"{mib(need.kv_cache)} + recurrent state {mib(need.recurrent)} + compute buffer "
        f"{mib(need.compute)}; the device has {mib(need.free)} free of {mib(need.total)}, "
        f"this replica's budget is {mib(budget)} ({shared}less {HEADROOM:.0%} headroom). "
        "Lower n_ctx (KV cache), n_slots (KV and recurrent state per slot), n_batch "
        "(compute buffer) or n_gpu_layers (weights), or give each replica more of the GPU "
        "(num_gpus_per_replica)"
    )
