"""Decode speed of each model family on the native engine against transformers' forward, on
random weights from configs/ (shapes scaled so a CPU run takes seconds).

Each family runs `llmcli bench --engine native` and `--engine transformers` in turn, the same
config, prompt and token counts; every figure is the median of --runs runs with the lowest and
highest beside it. The MoE also runs against a dense model of the same *active* size (its top-k
experts' width as one MLP): the MoE's cost over it is the routing and the gather.

    python scripts/bench_families.py [--runs 5] [--new-tokens 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAMILIES = {
    "Qwen3-MoE (32 experts, top-4)": "qwen3-moe-cpu-bench.json",
    "Mixtral (8 experts, top-2)": "mixtral-cpu-bench.json",
    "Phi-4-mini shape (fused, partial RoPE)": "phi4-mini-cpu-bench.json",
    "Gemma 3 shape (5 sliding layers of 512 per global)": "gemma3-cpu-bench.json",
    "Gemma 2 shape (soft-capped, sliding layers of 512 alternating)": "gemma2-cpu-bench.json",
    "gpt-oss shape (sinks, 32 experts, top-4, window 128)": "gpt-oss-cpu-bench.json",
    "Gemma 4 E2B shape (wider full layers, 4 of 10 reading KV, per-layer inputs)": "gemma4-cpu-bench.json",
    "Gemma 4 26B-A4B shape (32 experts, top-4, beside a dense MLP)": "gemma4-moe-cpu-bench.json",
    "Qwen3 dense, the MoE's active size": "qwen3-dense-moe-active-cpu-bench.json",
}
# llmcli's own int8/int4 on the MoE (experts quantized one by one, bf16 activations), against
# transformers' unquantized forward of the same config: what a CPU user of an MoE gets.
QUANTIZED = {
    "Qwen3-MoE, --quant int8": ("qwen3-moe-cpu-bench.json", "int8"),
    "Qwen3-MoE, --quant int4": ("qwen3-moe-cpu-bench.json", "int4"),
}


def bench(config: Path, engine: str, args: argparse.Namespace, quant: str = "none") -> dict:
    command = [
        sys.executable, "-m", "llmcli", "bench", "--config", str(config), "--random-weights", "--json",
        "--engine", engine, "--device", args.device, "--runs", str(args.runs), "-n", str(args.new_tokens),
        "--prompt-lengths", str(args.prompt_length), "--no-generate", "--quant", quant,
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{config.name} ({engine}): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def cell(report: dict) -> str:
    low, high = report["spread"].get("decode_tok_s", (report["decode_tok_s"], report["decode_tok_s"]))
    return f"{report['decode_tok_s']:.1f} ({low:.1f}–{high:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows, native, baseline = [], {}, {}
    for family, name in FAMILIES.items():
        ours = bench(CONFIGS / name, "native", args)
        theirs = baseline[name] = bench(CONFIGS / name, "transformers", args)
        native[name] = ours
        ratio = ours["decode_tok_s"] / theirs["decode_tok_s"]
        rows.append((family, ours["engine"], cell(ours), cell(theirs), f"{ratio:.2f}×"))
    if args.device == "cpu":  # quantized experts run on a CPU only so far
        for label, (name, quant) in QUANTIZED.items():
            ours, theirs = bench(CONFIGS / name, "native", args, quant), baseline[name]
            ratio = ours["decode_tok_s"] / theirs["decode_tok_s"]
            rows.append((label, ours["engine"], cell(ours), cell(theirs) + " (unquantized)", f"{ratio:.2f}×"))
    print(f"decode tok/s, median (lowest–highest) of {args.runs} runs · {args.new_tokens} new tokens after "
          f"{args.prompt_length} · {args.device} · random weights\n")  # fmt: skip
    print("| family | engine picked | native | transformers | native / transformers |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    moe, dense = native["qwen3-moe-cpu-bench.json"], native["qwen3-dense-moe-active-cpu-bench.json"]
    print(
        f"\nQwen3-MoE against a dense model of its active size, both native: "
        f"{moe['decode_tok_s'] / dense['decode_tok_s']:.2f}× its decode speed"
    )


if __name__ == "__main__":
    main()
