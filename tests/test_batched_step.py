"""The fixed-shape decode step of several sequences (engine/native/batched.py: what a CUDA graph
per batch bucket and length bucket replays), run eagerly on the CPU with `static_shapes`: each
row what its sequence gives alone, in fp32, as sequences join and leave (the batch bucket
changing) and the longest crosses a length bucket. Models the fixed shapes do not serve keep
the eager batched step, and say why."""

from __future__ import annotations

import pytest
import torch

from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.batched import BatchedDecode, batch_bucket
from llmcli.engine.native.forward import Transformer
from test_native import CASES, CONTEXT, GPT_OSS, build, prompt

# Rows multiplied together in one GEMM, alone in a GEMV: another order of summation (as
# test_native's several-sequences test measures).
ATOL = 3e-5
BATCHED_CASES = {
    **{name: CASES[name] for name in ("llama-gqa2", "qwen3-qk-norm", "qwen3-moe-k2", "phi3-fused")},
    # A window shorter than the context but too long for a ring (kvcache.ring_size): the layers
    # live in the pool and the step masks each row to its window (the fifth sequence passes it).
    "mistral-window-480": ("mistral", {"sliding_window": 480}),
    # Sinks, scored by hand (attention.py), every layer in the pool.
    "gpt-oss-sinks-no-ring": ("gpt_oss", {**GPT_OSS, "sliding_window": 1024}),
}
LENGTHS = (250, 40, 130, 9, 475)


# From which step which sequences decode together: three (a batch of 4 rows), the fourth joins
# (4), the second sits a few steps out as a straggler would (3 rows: 4), it comes back and the
# fifth joins (8 rows), the second leaves (4).
SCHEDULE = ((0, [0, 1, 2]), (4, [0, 1, 2, 3]), (8, [0, 2, 3]), (12, [0, 1, 2, 3, 4]), (16, [0, 2, 3, 4]))
STEPS = 20


def joined_at(step: int) -> list[int]:
    return next(going for start, going in reversed(SCHEDULE) if step >= start)


def decode_joining(
    batched: BatchedDecode, context: int, prompts: list[list[int]], steps: int = STEPS
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """The sequences decoded greedily through `batched` as `joined_at` says, their caches slots
    of its pool: the first four made at once (the steps make the scratch slot at the fourth's
    index before it joins), the fifth as it joins (after the scratch slot was made at its
    index). Each takes its slot as it joins, and the next step makes the scratch slot past it.
    Returns each sequence's tokens, and its logits at each step."""
    net, pool = batched.net, batched.pool
    together = [NativeBackend(None, context, net=net, pool=pool) for _ in prompts[:4]]
    tokens: list[list[int]] = []
    logits: list[list[torch.Tensor]] = []
    for step in range(steps):
        going = joined_at(step)
        while len(tokens) <= max(going):
            if len(together) == len(tokens):
                together.append(NativeBackend(None, context, net=net, pool=pool))
            tokens.append([int(together[len(tokens)].prefill(prompts[len(tokens)]).argmax())])
            logits.append([])
        feed = torch.tensor([tokens[s][-1] for s in going], device=net.device)
        rows = batched.step(feed, [together[s].cache for s in going])
        if batched.fixed:
            assert pool.slots == pool.held + 1  # the scratch slot past every sequence's
        for row, sequence in enumerate(going):
            logits[sequence].append(rows[row : row + 1].clone())
            tokens[sequence].append(int(rows[row].argmax()))
    assert [backend.length for backend in together] == [
        len(ids) + len(steps_taken) for ids, steps_taken in zip(prompts, logits, strict=True)
    ]
    return tokens, logits


def assert_each_as_alone(
    net: Transformer, prompts: list[list[int]], tokens: list[list[int]], logits: list[list[torch.Tensor]]
) -> None:
    """Each sequence's tokens and logits step by step what it gives decoded alone (exact length)."""
    for ids, got_tokens, got_logits in zip(prompts, tokens, logits, strict=True):
        alone = NativeBackend(None, CONTEXT, net=net)
        expected = [int(alone.prefill(ids).argmax())]
        for got in got_logits:
            step = alone.decode(torch.tensor([expected[-1]]))
            torch.testing.assert_close(got, step, rtol=0, atol=ATOL)
            expected.append(int(step.argmax()))
        assert got_tokens == expected


@pytest.mark.parametrize("case", list(BATCHED_CASES))
@torch.inference_mode()
def test_sequences_through_the_padded_step_each_equal_it_alone(case: str) -> None:
    """Five sequences of unlike lengths: every row's logits within ATOL of its sequence decoded
    alone and the greedy tokens the same, step after step, through batch buckets 4 → 8 → 4
    (SCHEDULE) and the length bucket 256 → 512 (the first passing 256, the fifth joining at
    475 tokens)."""
    net = NativeBackend(build(*BATCHED_CASES[case]), CONTEXT).net
    batched = BatchedDecode(net, net.new_pool(CONTEXT), graphs=False, static_shapes=True)
    assert batched.fixed and batched.eager_reason is None
    prompts = [prompt(length, seed=70 + index) for index, length in enumerate(LENGTHS)]
    assert_each_as_alone(net, prompts, *decode_joining(batched, CONTEXT, prompts))


def test_batch_buckets_are_powers_of_two() -> None:
    assert [batch_bucket(count) for count in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


@torch.inference_mode()
def test_a_model_with_rings_keeps_the_eager_batched_step() -> None:
    """Gemma 3's sliding layers keep a ring per sequence, outside the pool: the fixed shapes are
    not taken, the reason is said, and the step still gives each row its sequence's logits."""
    net = NativeBackend(build(*CASES["gemma3-window-8-shorter-than-the-prompt"]), CONTEXT).net
    pool = net.new_pool(CONTEXT)
    batched = BatchedDecode(net, pool, graphs=False, static_shapes=True)
    assert not batched.fixed
    assert batched.eager_reason == "its sliding-window layers keep a ring per sequence"
    prompts = [prompt(length, seed=90 + index) for index, length in enumerate(LENGTHS)]
    tokens, logits = decode_joining(batched, CONTEXT, prompts, steps=14)
    assert pool.slots == len(LENGTHS)  # no scratch slot: the padded step never ran
    assert_each_as_alone(net, prompts, tokens, logits)
