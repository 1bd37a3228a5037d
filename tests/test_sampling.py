"""Each sampling rule equals its transformers LogitsProcessor twin on random logits."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmcli.config.settings import SamplingParams
from llmcli.engine import sampling

VOCAB = 1000


@pytest.fixture(params=range(5), ids=lambda seed: f"seed{seed}")
def logits(request: pytest.FixtureRequest) -> torch.Tensor:
    generator = torch.Generator().manual_seed(request.param)
    # A few rows at different scales: flat, ordinary and very peaked distributions.
    scales = torch.tensor([[0.1], [1.0], [3.0], [10.0]])
    return torch.randn(4, VOCAB, generator=generator) * scales


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "a different set of tokens was removed"
    finite = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_temperature(logits: torch.Tensor, temperature: float) -> None:
    assert_same(
        sampling.apply_temperature(logits, temperature), TemperatureLogitsWarper(temperature)(None, logits)
    )


@pytest.mark.parametrize("k", [1, 5, 40, 999])
def test_top_k(logits: torch.Tensor, k: int) -> None:
    assert_same(sampling.filter_top_k(logits, k), TopKLogitsWarper(k)(None, logits))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_top_p(logits: torch.Tensor, p: float) -> None:
    assert_same(sampling.filter_top_p(logits, p), TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.2, 0.9, 1.0])
def test_min_p(logits: torch.Tensor, min_p: float) -> None:
    assert_same(sampling.filter_min_p(logits, min_p), MinPLogitsWarper(min_p)(None, logits))


@pytest.mark.parametrize("penalty", [0.8, 1.1, 1.3, 2.0])
def test_repetition_penalty(logits: torch.Tensor, penalty: float) -> None:
    seen = torch.randint(0, VOCAB, (logits.shape[0], 30), generator=torch.Generator().manual_seed(7))
    ours = sampling.apply_repetition_penalty(logits, seen, penalty)
    assert_same(ours, RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone()))
    assert not torch.equal(ours, logits)


def test_disabled_rules_change_nothing(logits: torch.Tensor) -> None:
    off = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    seen = torch.zeros(4, 0, dtype=torch.long)
    assert torch.equal(sampling.process_logits(logits, seen, off), logits)


def test_greedy_picks_the_argmax_whatever_the_filters(logits: torch.Tensor) -> None:
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)
    seen = torch.zeros(4, 0, dtype=torch.long)
    picked = sampling.pick_token(sampling.process_logits(logits, seen, greedy), greedy, None)
    assert torch.equal(picked, logits.argmax(dim=-1))


def test_sampling_only_draws_kept_tokens(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=1.0, top_k=5)
    seen = torch.zeros(4, 0, dtype=torch.long)
    filtered = sampling.process_logits(logits, seen, params)
    generator = sampling.make_generator(0, torch.device("cpu"))
    for _ in range(50):
        picked = sampling.pick_token(filtered, params, generator)
        assert torch.isfinite(filtered.gather(1, picked[:, None])).all()


def test_same_seed_same_draws() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)

    def draws(seed: int) -> list[int]:
        generator = sampling.make_generator(seed, torch.device("cpu"))
        return [int(sampling.pick_token(logits, params, generator)) for _ in range(20)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (1.5, -0.3), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_count_each_seen_token(
    logits: torch.Tensor, presence: float, frequency: float
) -> None:
    generator = torch.Generator().manual_seed(7)
    seen = torch.randint(0, 50, (logits.shape[0], 40), generator=generator)  # many repeats
    ours = sampling.apply_presence_and_frequency(logits, seen, presence, frequency)
    expected = logits.clone()
    for row in range(logits.shape[0]):
        for token in set(seen[row].tolist()):
            times = seen[row].tolist().count(token)
            expected[row, token] -= frequency * times + presence
    torch.testing.assert_close(ours, expected)


def test_logit_bias_adds_to_the_named_tokens_only(logits: torch.Tensor) -> None:
    bias = ((3, 5.0), (999, -100.0))
    ours = sampling.apply_logit_bias(logits, bias)
    expected = logits.clone()
    expected[:, 3] += 5.0
    expected[:, 999] -= 100.0
    torch.testing.assert_close(ours, expected)
    greedy = SamplingParams(temperature=0.0, logit_bias=((5, 1000.0),))
    picked = sampling.pick_token(sampling.process_logits(logits, sampling.NOTHING_SEEN, greedy), greedy, None)
    assert picked.tolist() == [5] * logits.shape[0]
