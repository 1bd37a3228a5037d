"""The fast decode path on CUDA: the one-token step captured as a CUDA graph.

At batch 1 a decode step launches hundreds of small kernels, and launching them from Python
costs more than running them on a modern GPU. torch.compile's "reduce-overhead" mode records the
step once as a CUDA graph and replays it with one launch per token; the static KV cache gives it
the fixed shapes and addresses that replay needs. The compile cost is paid once per process, and
inductor's artefacts are kept in llmcli's cache directory so the next process compiles faster.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from llmcli.config.paths import cache_dir


def compile_decode_step(step: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    # The step's inputs change every token; the cache tensors are marked static by transformers.
    return torch.compile(step, mode="reduce-overhead", fullgraph=False, dynamic=False)


def fast_path_default(device_type: str, requested: bool | None) -> bool:
    """--fast/--no-fast if given; else on where it pays: CUDA (graphs), not CPU or MPS."""
    return requested if requested is not None else device_type == "cuda"
