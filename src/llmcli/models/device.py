"""Where a model runs and how: the device and dtype `auto` picks, and how many CPU threads.

Device auto: CUDA if present, else Apple MPS, else CPU. Dtype auto: bf16 where the GPU supports it,
else fp16 on GPUs, fp32 on CPU (CPU half-precision matmuls are slow or missing on many machines;
a GGUF file's 16-bit weights are the exception where they are not: gguf_float_dtype).
"""

from __future__ import annotations

import os

import torch

from llmcli.errors import LlmcliError
from llmcli.models.busy_cores import busy_cores_elsewhere

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {value: key for key, value in _DTYPES.items()}


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LlmcliError(
            f"--device {requested} was asked for, but torch sees no CUDA GPU (torch {torch.__version__})",
            "use --device cpu, or install a CUDA build of torch",
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise LlmcliError(f"--device {requested} was asked for, but MPS is not available", "use --device cpu")
    return device


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


# A GGUF file's 16-bit weights, held in their own width on a CPU whose torch runs 16-bit
# matrix products natively (AVX-512 here: a 576 × 1536 fp16 GEMV 45 µs, bf16 77, fp32 232 on
# 2 cores), rather than widened to fp32 at twice the file's size. Elsewhere fp32, as a CPU's
# default (half-precision products are slow or missing on many).
_GGUF_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
_NATIVE_HALF_CAPABILITIES = frozenset({"AVX512", "AVX512_BF16", "AMX"})


def gguf_float_dtype(type_name: str | None, device: torch.device) -> torch.dtype | None:
    """The width to hold a GGUF file's weights of GGUF's type `type_name` in on `device`, where
    it is its own (F16, BF16), else None (the dtype `auto` picks)."""
    if device.type != "cpu" or torch.backends.cpu.get_cpu_capability() not in _NATIVE_HALF_CAPABILITIES:
        return None
    return _GGUF_FLOAT_DTYPES.get(type_name or "")


def configure_cpu_threads(threads: int | None) -> int:
    """Set torch's intra-op threads: `threads` if given, else one per core that is free now.

    torch's default, one thread per core, is fastest on an idle machine, but its OpenMP workers
    meet at a barrier after every matmul: when another process holds one of the cores, every
    step waits for the thread stuck behind it. Measured on 2 cores with SmolLM2-135M: 2 threads
    give 26.6 tok/s idle but 0.8 tok/s with the other core busy; 1 thread gives 16.2 and 15.9.
    So we count the cores other processes are using right now and leave them alone.
    """
    if threads is None:
        cores = available_cores()
        threads = max(1, cores - min(cores - 1, busy_cores_elsewhere()))
    torch.set_num_threads(threads)
    return threads


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
