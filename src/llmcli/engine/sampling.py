"""Sampling as small pure functions on logits of shape [batch, vocab].

Each filter sets the logits it removes to -inf and leaves the rest untouched, so filters compose.
The order is transformers' own (repetition penalty, temperature, top-k, top-p, min-p), and each
function is tested to equal its transformers `LogitsProcessor` twin.
"""

from __future__ import annotations

import torch

from llmcli.config.settings import SamplingParams

_REMOVED = -float("inf")
# Below this, any gap between two logits of 1e-4 or more is a factor of e^-100 or less.
TINY_TEMPERATURE = 1e-6
# No tokens seen: what the repetition penalty gets when it is off.
NOTHING_SEEN = torch.zeros(1, 0, dtype=torch.long)


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty: for every token already seen, divide a positive logit by `penalty`
    and multiply a negative one, so the token always becomes less likely (for penalty > 1)."""
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    seen = torch.gather(logits, 1, seen_ids)
    penalised = _capped(torch.where(seen < 0, seen * penalty, seen / penalty))
    return logits.scatter(1, seen_ids, penalised)


def apply_presence_and_frequency(
    logits: torch.Tensor, seen_ids: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties, as vLLM computes them: each token already seen loses `presence`
    once and `frequency` for every time it was seen (here over the prompt and the reply, the
    tokens the repetition penalty looks at, as llama.cpp applies them)."""
    if (presence == 0 and frequency == 0) or seen_ids.numel() == 0:
        return logits
    counts = torch.zeros_like(logits).scatter_add_(1, seen_ids, torch.ones_like(seen_ids, dtype=logits.dtype))
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's logit_bias: a number added to given tokens' logits (-100 all but bans one)."""
    if not bias:
        return logits
    ids = torch.tensor([token for token, _ in bias], device=logits.device)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(1, ids, values.expand(logits.shape[0], -1))


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """p ∝ exp(logit / T): T < 1 sharpens the distribution, T > 1 flattens it.

    A T so small that exp((logit - best) / T) is 0 for every gap between logits is its limit:
    the best tokens only (computing it would overflow to inf, and inf - inf is NaN)."""
    if temperature == 1.0:
        return logits
    if temperature < TINY_TEMPERATURE:
        return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True), _REMOVED)
    return _capped(logits / temperature) if temperature < 1.0 else logits / temperature


def _capped(logits: torch.Tensor) -> torch.Tensor:
    """Logits that overflowed to +inf (a tiny penalty or temperature) held at the largest finite
    value: softmax subtracts the max, and inf - inf would be NaN. Finite logits are untouched."""
    return logits.clamp(max=torch.finfo(logits.dtype).max)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits (ties with the k-th are kept too). k = 0 keeps all."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_best, _REMOVED)


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability mass reaches p.

    Sorted ascending, a token is dropped when the mass of it and everything less likely is
    ≤ 1 - p; the most likely token always stays.
    """
    if p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, descending=False, dim=-1)
    mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_up_to <= 1 - p
    drop_sorted[..., -1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, _REMOVED)


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p × the top token's probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    drop = probs < threshold
    # The most likely token always stays, even when min_p = 1 and there is a tie at the top.
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(drop, _REMOVED)


def process_logits(logits: torch.Tensor, seen_ids: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Every enabled rule, in transformers' order, after the bias a request gave. Greedy only
    needs the bias and the penalties."""
    logits = apply_logit_bias(logits, params.logit_bias)
    logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    logits = apply_presence_and_frequency(logits, seen_ids, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return logits
    logits = apply_temperature(logits, params.temperature)
    logits = filter_top_k(logits, params.top_k)
    logits = filter_top_p(logits, params.top_p)
    return filter_min_p(logits, params.min_p)


def pick_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token id per row, shape [batch]: argmax when greedy, else a draw from softmax."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = logits.float().softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
