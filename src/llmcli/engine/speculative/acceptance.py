"""The speculative-sampling acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

A token d drafted with probability q(d), where the model gives p(d), is kept with probability
min(1, p(d)/q(d)); when it is not, the token is drawn from max(0, p − q), renormalised. The
token that comes out is distributed exactly as p. A lookup draft has no probabilities: it is a
point mass (q(d) = 1), so d is kept with probability p(d), and otherwise the token is drawn from
p with d removed.
"""

from __future__ import annotations

import torch


def accept_or_resample(
    probs: torch.Tensor, drafted: int, draft_probs: torch.Tensor | None, generator: torch.Generator | None
) -> int:
    """The token for this position, given the model's `probs` [vocab] and the draft's
    distribution `draft_probs` [vocab] (None: a point mass on `drafted`). It equals `drafted`
    exactly when the draft is accepted: the resampled distribution is zero there."""
    p_drafted = float(probs[drafted])
    q_drafted = 1.0 if draft_probs is None else float(draft_probs[drafted])
    draw = float(torch.rand((), generator=generator, device=probs.device))
    if draw * q_drafted < p_drafted:
        return drafted
    residual = probs.clone() if draft_probs is None else (probs - draft_probs).clamp_min(0)
    residual[drafted] = 0  # rejected: p(d) < q(d), so max(0, p − q) is 0 there already, bar rounding
    total = float(residual.sum())
    if total <= 0:  # p == q up to rounding, where the draft is always kept anyway
        return drafted
    return int(torch.multinomial(residual / total, num_samples=1, generator=generator))
