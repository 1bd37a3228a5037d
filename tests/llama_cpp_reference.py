"""How llmcli's logits are held to llama.cpp's own on the GGUF fixtures (../shared/gguf-fixtures):
used by tests/test_gguf_fixtures.py, and importable by scripts/gguf_fixtures.py."""

from __future__ import annotations

import math

import numpy as np
import torch


def kl_and_top1(reference: np.ndarray, ours: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference ‖ ours) per position (nats) and the share of positions whose top token
    agrees, in float64."""
    p = torch.log_softmax(torch.from_numpy(reference).double(), dim=-1)
    q = torch.log_softmax(ours.double(), dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1).mean()
    return float(kl), float((p.argmax(-1) == q.argmax(-1)).double().mean())


def perplexity(logits: torch.Tensor, ids: np.ndarray) -> float:
    """exp(mean over i of −log softmax(logits[i])[ids[i + 1]]), in float64: the fixtures'
    manifest's definition."""
    rows = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(float(-rows[torch.arange(len(ids) - 1), torch.from_numpy(ids[1:])].mean()))
