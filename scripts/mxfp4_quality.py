"""gpt-oss's MXFP4 experts, dequantized (what llmcli runs) against the same experts requantized to
llmcli's int4 (groups of 32, the MXFP4 block size) — would keeping them 4-bit for the int4 kernels
be exact enough?

A tiny gpt-oss (tests/tiny_models.py) gets random MXFP4 experts, as the released checkpoints store
them, and loads through llmcli's loader (dequantized: there is no MXFP4 kernel here). Over text the
dequantized model wrote itself (greedy, so its perplexity is low and meaningful), both are scored:
perplexity, the mean KL divergence of the int4 model's next-token distribution from the
dequantized one's, and how often their top tokens agree. Everything is fp32 on the CPU.

    python scripts/mxfp4_quality.py [--tokens 256] [--seeds 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llmcli.config.settings import LoadSettings
from llmcli.engine.native.backend import NativeBackend
from llmcli.models.load import load_model
from llmcli.models.quantized import quantize_experts, stacked_experts
from llmcli.models.resolve import resolve_model

from tiny_models import build_tiny_model, mxfp4_experts


@torch.inference_mode()
def scores(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Log-probabilities of the next token at every position, [len(ids), vocab]."""
    backend = NativeBackend(model, len(ids) + 1)
    return torch.cat([F.log_softmax(backend.score([token]), dim=-1) for token in ids])


@torch.inference_mode()
def greedy_text(model: torch.nn.Module, length: int, seed: int) -> list[int]:
    backend = NativeBackend(model, length + 1)
    token = int(torch.randint(3, 300, (1,), generator=torch.Generator().manual_seed(seed)))
    ids = [token]
    logits = backend.prefill(ids)
    while len(ids) < length:
        token = int(logits.argmax())
        ids.append(token)
        logits = backend.decode(torch.tensor([token]))
    return ids


def perplexity(logprobs: torch.Tensor, ids: list[int]) -> float:
    """Of `ids` after their first token, from each position's log-probabilities."""
    targets = torch.tensor(ids[1:])
    return float(torch.exp(-logprobs[:-1].gather(1, targets[:, None]).mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seeds):
            path = mxfp4_experts(build_tiny_model(Path(folder) / f"mxfp4-{seed}", "gpt_oss", seed=seed), seed)
            loaded = load_model(resolve_model(str(path)), LoadSettings(device="cpu", dtype="fp32", threads=2))
            dequantized = loaded.model
            int4 = copy.deepcopy(dequantized)
            for experts in stacked_experts(int4):
                quantize_experts(experts, "int4", 32)
            ids = greedy_text(dequantized, args.tokens, seed)
            reference, ours = scores(dequantized, ids), scores(int4, ids)
            kl = F.kl_div(ours, reference, log_target=True, reduction="none").sum(-1).mean()
            agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean()
            rows.append((perplexity(reference, ids), perplexity(ours, ids), float(kl), float(agree)))
    print(f"tiny gpt-oss, random MXFP4 experts, {args.tokens} greedy tokens of its own, {args.seeds} seeds\n")
    print("| seed | perplexity, dequantized | perplexity, int4 g32 experts | mean KL | top-1 agreement |")
    print("|---:|---:|---:|---:|---:|")
    for seed, (ppl, ppl4, kl, agree) in enumerate(rows):
        print(f"| {seed} | {ppl:.3f} | {ppl4:.3f} | {kl:.2e} | {agree:.1%} |")
    print(f"\nmedian KL {statistics.median(r[2] for r in rows):.2e}")


if __name__ == "__main__":
    main()
