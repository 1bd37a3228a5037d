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
from test_native import CASES, CONTEXT, GPT_OSS, build, prompt

# Rows multiplied together in one GEMM, alone in a GEMV: another order of summation (as
# test_native's several-sequences test measures).
ATOL = 3e-5
BATCHED_CASES = {
    **{name: CASES[name] for name in ("llama-gqa2", "qwen3-qk-norm", "qwen3-moe-k2", "phi3-fused")},
    # A window shorter than the context but too long for a ring (kvcache.ring_size): the layers
    # live in the pool and the step masks each row to its window (the fourth sequence passes it).
    "mistral-window-480": ("mistral", {"sliding_window": 480}),
    # Sinks, scored by hand (attention.py), every layer in the pool.
    "gpt-oss-sinks-no-ring": ("gpt_oss", {**GPT_OSS, "sliding_window": 1024}),
}
LENGTHS = (250, 40, 130, 470, 9)


def joined_at(step: int) -> list[int]:
    """The sequences in step `step`: three (a batch of 4 rows), the fourth joins (4), the fifth
    (8 rows), then the second leaves (4 again)."""
    going = [0, 1, 2] + ([3] if step >= 4 else []) + ([4] if step >= 8 else [])
    return [s for s in going if not (s == 1 and step >= 12)]


@pytest.mark.parametrize("case", list(BATCHED_CASES))
@torch.inference_mode()
def test_sequences_through_the_padded_step_each_equal_it_alone(case: str) -> None:
    """Five sequences of unlike lengths: every row's logits within ATOL of its sequence decoded
    alone and the greedy tokens the same, step after step, through batch buckets 4 → 4 → 8 → 4
    and the length bucket 256 → 512 (the fourth joining at 470 tokens, the first passing 256).
    The fifth sequence's cache is made once the steps have made the scratch slot: it takes that
    slot, and the next step makes another."""
    model = build(*BATCHED_CASES[case])
    net = NativeBackend(model, CONTEXT).net
    pool = net.new_pool(CONTEXT)
    batched = BatchedDecode(net, pool, graphs=False, static_shapes=True)
    assert batched.fixed and batched.eager_reason is None
    together: list[NativeBackend] = []
    alone = [NativeBackend(None, CONTEXT, net=net) for _ in LENGTHS]
    prompts = [prompt(length, seed=70 + index) for index, length in enumerate(LENGTHS)]
    tokens: list[int] = []
    for step in range(16):
        going = joined_at(step)
        while len(tokens) <= max(going):
            sequence = len(tokens)
            together.append(NativeBackend(None, CONTEXT, net=net, pool=pool))
            expected = alone[sequence].prefill(prompts[sequence])
            prefilled = together[sequence].prefill(prompts[sequence])
            torch.testing.assert_close(prefilled, expected, rtol=0, atol=1e-5)
            tokens.append(int(expected.argmax()))
        rows = batched.step(torch.tensor([tokens[s] for s in going]), [together[s].cache for s in going])
        assert pool.slots == pool.held + 1  # the scratch slot past every sequence's
        for row, sequence in enumerate(going):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            torch.testing.assert_close(rows[row : row + 1], expected, rtol=0, atol=ATOL)
            assert int(rows[row].argmax()) == int(expected.argmax())
            tokens[sequence] = int(expected.argmax())
    assert [backend.length for backend in together] == [
        length + sum(s in joined_at(step) for step in range(16)) for s, length in enumerate(LENGTHS)
    ]


def test_batch_buckets_are_powers_of_two() -> None:
    assert [batch_bucket(count) for count in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


@torch.inference_mode()
def test_a_model_with_rings_keeps_the_eager_batched_step() -> None:
    """Gemma 3's sliding layers keep a ring per sequence, outside the pool: the fixed shapes are
    not taken, the reason is said, and the step still gives each row its sequence's logits."""
    model = build(*CASES["gemma3-window-8-shorter-than-the-prompt"])
    net = NativeBackend(model, CONTEXT).net
    pool = net.new_pool(CONTEXT)
    batched = BatchedDecode(net, pool, graphs=False, static_shapes=True)
    assert not batched.fixed
    assert batched.eager_reason == "its sliding-window layers keep a ring per sequence"
    together = [NativeBackend(None, CONTEXT, net=net, pool=pool) for _ in range(3)]
    alone = [NativeBackend(None, CONTEXT, net=net) for _ in range(3)]
    prompts = [prompt(length, seed=90 + length) for length in (120, 100, 140)]
    tokens = [int(a.prefill(ids).argmax()) for a, ids in zip(alone, prompts, strict=True)]
    for backend, ids in zip(together, prompts, strict=True):
        backend.prefill(ids)
    for _ in range(4):
        rows = batched.step(torch.tensor(tokens), [backend.cache for backend in together])
        assert pool.slots == 3  # no scratch slot: the padded step never ran
        for sequence in range(3):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            torch.testing.assert_close(rows[sequence : sequence + 1], expected, rtol=0, atol=ATOL)
            tokens[sequence] = int(expected.argmax())
