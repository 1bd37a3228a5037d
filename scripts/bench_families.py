"""Decode speed of each model family on the native engine against transformers' forward, on
random weights from configs/ (shapes scaled so a CPU run takes seconds).

Each family runs `llmcli bench --engine native` and `--engine transformers` in turn, the same
config, prompt and token counts; every figure is the median of --runs runs with the lowest and
highest beside it. The MoE also runs against a dense model of the same *active* size (its top-k
experts' width as one MLP): the MoE's cost over it is the routing and the gather.

`--set qwen3.5` runs the Qwen3.5 and Qwen3-Next shapes instead, at their published sizes (their
language models: configs/qwen3.5-*.json, qwen3-next-80b-a3b.json), prefill and decode, native
against transformers: the larger ones need the memory of their size (a GPU's, or many GB of RAM).

    python scripts/bench_families.py [--runs 5] [--new-tokens 32] [--device cpu] [--set qwen3.5]
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
# Qwen3.5's published sizes (each checkpoint's text_config; 2B's widths partly guessed) and
# Qwen3-Next's, smallest first.
QWEN3_5 = {
    "Qwen3.5-0.8B (24 layers, 1 in 4 full attention)": "qwen3.5-0.8b.json",
    "Qwen3.5-2B": "qwen3.5-2b.json",
    "Qwen3.5-9B": "qwen3.5-9b.json",
    "Qwen3.5-35B-A3B (256 experts, top-8, a shared expert)": "qwen3.5-35b-a3b.json",
    "Qwen3-Next-80B-A3B (512 experts, top-10, a shared expert)": "qwen3-next-80b-a3b.json",
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


def prefill_cell(report: dict, length: int) -> str:
    value = report["prefill_tok_s"][str(length)]
    low, high = report["spread"].get(f"prefill_tok_s@{length}", (value, value))
    return f"{value:.1f} ({low:.1f}–{high:.1f})"


def qwen3_5_table(args: argparse.Namespace) -> None:
    """Prefill and decode of each Qwen3.5 / Qwen3-Next shape, native against transformers."""
    print(f"tok/s, median (lowest–highest) of {args.runs} runs · prefill of {args.prompt_length} tokens, "
          f"then {args.new_tokens} decoded · {args.device} · random weights\n")  # fmt: skip
    print("| shape | native prefill | transformers prefill | native / transformers | native decode "
          "| transformers decode | native / transformers |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    length = args.prompt_length
    for label, name in QWEN3_5.items():
        ours, theirs = bench(CONFIGS / name, "native", args), bench(CONFIGS / name, "transformers", args)
        prefill = ours["prefill_tok_s"][str(length)] / theirs["prefill_tok_s"][str(length)]
        decode = ours["decode_tok_s"] / theirs["decode_tok_s"]
        cells = (prefill_cell(ours, length), prefill_cell(theirs, length), f"{prefill:.2f}×")
        print(f"| {label} | " + " | ".join((*cells, cell(ours), cell(theirs), f"{decode:.2f}×")) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", choices=("families", "qwen3.5"), default="families")
    args = parser.parse_args()
    if args.set == "qwen3.5":
        qwen3_5_table(args)
        return
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
