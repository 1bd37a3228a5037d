"""What quantization costs in quality, measured: perplexity and greedy agreement, as a table.

For the demo model (or -m MODEL), in one process, for each weight format: perplexity on a fixed
text shipped with the repo (scripts/data/quality.txt), and greedy agreement with the fp32 model
over a fixed set of prompts (identical replies, and the mean length of the identical prefix).
Every variant runs through transformers' model code on the weights llmcli loaded (its own int8 /
int4 layers included), so the figures are about the weights, not the engine.

  python scripts/quality.py                     # every variant below, on the demo model
  python scripts/quality.py --tokens 48 --variants fp32,int4
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.conversation import build_messages, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model

TEXT = Path(__file__).parent / "data" / "quality.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a lighthouse keeper does, in two sentences.",
    "List three primary colours.",
    "What is 12 times 12?",
    "Give one tip for writing clear emails.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly.",
    "Name a planet in our solar system.",
    "Suggest a name for a grey cat.",
]
VARIANTS = {  # name → load settings beyond the device
    "fp32": {"dtype": "fp32", "quant": "none"},
    "bf16": {"dtype": "bf16", "quant": "none"},
    "int8": {"quant": "int8"},
    "int4": {"quant": "int4"},  # bf16 activations, as llmcli runs it
    "int4-fp32": {"quant": "int4", "dtype": "fp32"},  # the same weights with fp32 activations
}


@torch.inference_mode()
def perplexity(model, ids: list[int]) -> float:
    input_ids = torch.tensor([ids], device=model.device)
    logits = model(input_ids).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:])
    return math.exp(loss.item())


def greedy_replies(loaded, tokens: int) -> list[list[int]]:
    engine = Engine.for_loaded(loaded)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    replies = []
    for prompt in PROMPTS:
        engine.reset()
        replies.append(
            engine.complete(prompt_ids(loaded.tokenizer, build_messages(prompt)), params).token_ids
        )
    return replies


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="model spec (default: the demo model)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()

    resolved = resolve_model(args.model)
    reference: list[list[int]] | None = None
    rows = []
    for name in args.variants.split(","):
        loaded = load_model(resolved, LoadSettings(device="cpu", **VARIANTS[name]))
        ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
        replies = greedy_replies(loaded, args.tokens)
        reference = reference or replies
        same = sum(reply == ref for reply, ref in zip(replies, reference, strict=True))
        prefix = sum(shared_prefix(r, ref) for r, ref in zip(replies, reference, strict=True)) / len(PROMPTS)
        rows.append((name, loaded.quant, loaded.weight_bytes, perplexity(loaded.model, ids), same, prefix))
        del loaded

    base = rows[0][3]
    print(
        f"\n{resolved.name} · perplexity on {TEXT.name} ({len(ids)} tokens) · greedy agreement with "
        f"{rows[0][0]} over {len(PROMPTS)} prompts × {args.tokens} tokens\n"
    )
    print("| variant | quant | weights MB | perplexity | vs first | identical replies | shared prefix |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, quant, size, ppl, same, prefix in rows:
        print(
            f"| {name} | {quant} | {size / 1e6:.1f} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % | "
            f"{same}/{len(PROMPTS)} | {prefix:.1f} |"
        )


if __name__ == "__main__":
    main()
