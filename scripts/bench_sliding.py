"""Gemma 3's sliding layers, measured: decode speed at a long and a short cached context, and the
KV cache's bytes per token, against a dense-attention model of the very same shape.

Both models are built from configs/gemma3-cpu-bench.json with random weights (the dense one with
every layer global) and run on the native engine. For each (model, context) a cache is filled
once; each run crops back to the fill and times --new-tokens greedy decode steps (fewer than a
ring's slack, so the crop keeps the cache). Runs of the four are interleaved, so load on the
machine falls on all alike; figures are medians with the lowest and highest run beside them.

    python scripts/bench_sliding.py [--runs 5] [--new-tokens 32] [--long 8160] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llmcli.config.settings import LoadSettings
from llmcli.engine.bench import prompt_of, synchronize
from llmcli.engine.native.backend import NativeBackend
from llmcli.models.load import LoadedModel, load_random

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gemma3-cpu-bench.json"


def built(config: dict, folder: Path, name: str, device: str) -> LoadedModel:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return load_random(str(path), LoadSettings(device=device, engine="native"))


def decode_seconds(backend: NativeBackend, fill: int, new_tokens: int) -> float:
    backend.crop(fill)
    assert backend.length == fill, "the crop back to the fill must keep it"
    token = torch.zeros(1, dtype=torch.long, device=backend.device)
    synchronize(backend.device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = backend.decode(token).argmax(dim=-1)
    synchronize(backend.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--short", type=int, default=128)
    parser.add_argument("--long", type=int, default=8160, help="cached tokens (≤ context − new tokens)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sliding = json.loads(CONFIG.read_text())
    dense = {**sliding, "layer_types": ["full_attention"] * sliding["num_hidden_layers"]}
    fills = (args.short, args.long)
    cases: dict[tuple[str, int], NativeBackend] = {}
    with torch.inference_mode(), tempfile.TemporaryDirectory() as folder:
        for name, config in (("Gemma 3 shape (sliding)", sliding), ("same shape, every layer global", dense)):
            loaded = built(config, Path(folder), f"model{len(cases)}", args.device)
            for fill in fills:  # a cache for each fill, over the same weights
                backend = NativeBackend(loaded.model, loaded.context_length)
                backend.prefill(prompt_of(fill, config["vocab_size"]))
                cases[name, fill] = backend
        times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
        for _ in range(args.runs):
            for key, backend in cases.items():
                times[key].append(decode_seconds(backend, key[1], args.new_tokens))
    print(
        f"decode tok/s, median (lowest–highest) of {args.runs} runs · {args.new_tokens} tokens after the "
        f"cached ones · {args.device} · random weights · {CONFIG.name}\n"
    )
    columns = (
        f"at {args.short} cached | at {args.long} cached | long / short | KV bytes per token at {args.long}"
    )
    print(f"| model | {columns} |")
    print("|---|---:|---:|---:|---:|")
    for name in dict.fromkeys(key[0] for key in cases):
        rates = {}
        cells = []
        for fill in fills:
            values = [args.new_tokens / s for s in times[name, fill]]
            rates[fill] = statistics.median(values)
            cells.append(f"{rates[fill]:.1f} ({min(values):.1f}–{max(values):.1f})")
        cache = cases[name, args.long].cache
        per_token = cache.nbytes() / (args.long + args.new_tokens)
        ratio = rates[args.long] / rates[args.short]
        print(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f} | {per_token:,.0f} |")


if __name__ == "__main__":
    main()
