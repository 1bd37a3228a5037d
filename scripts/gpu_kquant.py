"""The GGUF block GEMVs (llmcli.models.gguf_cuda.matmul) on a config's layer shapes, against the
device's copy bandwidth: what share of it a decode step's products reach when every weight is a
file's blocks, read as stored. Prints one JSON object; where the kernels are not in this checkout,
{"status": "not built"} and why (exit 0: the lease goes on).

    python scripts/gpu_kquant.py --config configs/llama-3.1-8b.json [--types Q4_K,Q6_K]

Speed does not depend on the values, so the blocks are random bytes with their fp16 scales made
small finite numbers (random bytes are NaN or infinite scales now and then). On CUDA each product
is timed as CALLS launches in one CUDA graph (median of --runs replays), as scripts/bench_kernels.py
times the int8 and int4 GEMVs; elsewhere (Triton's interpreter: a dry run) once.
A step's share counts each shape as often as a step reads it: every layer's, and the head once.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmcli.engine.bench import interleaved_times, measure_bandwidth, timed
from random_gguf import BLOCKS, random_blocks

CALLS = 20


def layer_shapes(config: dict[str, Any]) -> tuple[dict[str, tuple[int, int]], int]:
    """({name: (out, in)} of one decoder layer's matrices and the head, as a GGUF file stores
    them (q, k, v, gate and up each its own tensor), the number of layers)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inner = config["intermediate_size"]
    shapes = {
        "attn_q": (heads * head_dim, hidden),
        "attn_k": (kv * head_dim, hidden),
        "attn_v": (kv * head_dim, hidden),
        "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (inner, hidden),
        "ffn_up": (inner, hidden),
        "ffn_down": (hidden, inner),
        "output": (config["vocab_size"], hidden),
    }
    return shapes, config["num_hidden_layers"]


def seconds_per_call(fn: Callable[[], object], device: torch.device, runs: int) -> float:
    if device.type != "cuda":  # Triton's interpreter: nothing to compile, each call ~0.5 s
        return timed(fn, device)
    fn()  # compiles the kernel outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return statistics.median(interleaved_times({"graph": graph.replay}, runs, device)["graph"]) / CALLS


def measure_type(
    matmul: Callable[..., torch.Tensor],
    type_name: str,
    shapes: dict[str, tuple[int, int]],
    layers: int,
    device: torch.device,
    runs: int,
) -> dict[str, Any]:
    per_shape: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(0)
    step_bytes = step_seconds = 0.0
    for name, (out, width) in shapes.items():
        blocks = torch.from_numpy(random_blocks(type_name, out, width, rng)).to(device)
        x = torch.randn(
            1, width, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device
        )
        seconds = seconds_per_call(
            lambda x=x, blocks=blocks, width=width: matmul(x, blocks, type_name, width), device, runs
        )
        moved = blocks.numel() + x.numel() * x.element_size()
        per_shape[name] = {"out": out, "in": width, "us": seconds * 1e6, "gb_s": moved / seconds / 1e9}
        count = 1 if name == "output" else layers
        step_bytes += count * moved
        step_seconds += count * seconds
        del blocks
    return {"gb_s": step_bytes / step_seconds / 1e9, "step_ms": step_seconds * 1e3, "shapes": per_shape}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a config.json: its layer shapes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--types", default=",".join(BLOCKS), help="comma-separated GGUF types")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--shapes", help="comma-separated tensor names (attn_q, …, output; default: all)")
    args = parser.parse_args()
    try:
        from llmcli.models.gguf_cuda import matmul
    except ImportError as error:
        print(json.dumps({"status": "not built", "why": f"llmcli.models.gguf_cuda: {error}"}))
        return
    device = torch.device(args.device)
    shapes, layers = layer_shapes(json.loads(Path(args.config).read_text()))
    if args.shapes:  # a dry run's few (Triton's interpreter takes ~0.5 s a call)
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    bandwidth = measure_bandwidth(device)
    record: dict[str, Any] = {"status": "measured", "device": str(device), "bandwidth_gb_s": bandwidth}
    record["config"], record["types"], record["failed"] = args.config, {}, {}
    for type_name in args.types.split(","):
        try:
            measured = measure_type(matmul, type_name, shapes, layers, device, args.runs)
        except (ValueError, RuntimeError, ImportError) as error:  # refused, or not runnable here
            record["failed"][type_name] = f"{type(error).__name__}: {error}"
            continue
        measured["pct_of_bandwidth"] = 100 * measured["gb_s"] / bandwidth
        record["types"][type_name] = measured
    print(json.dumps(record))


if __name__ == "__main__":
    main()
