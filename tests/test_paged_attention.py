"""Paged decode attention on the CPU (src/csrc/attention.c through engine/native/paged_cpu.py):
the kernel reading blocks in place against torch's SDPA over the same keys and values gathered
into one tensor, on every level this CPU runs, and what it does not take falling back to a
correct path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV, gathered_attention, paged_attention
from llmcli.models import cpu_kernels

LEVELS = [level for level in cpu_kernels.built_levels() if cpu_kernels.runs_here(level)]
needs_kernels = pytest.mark.skipif(not LEVELS, reason="llmcli was built without its compiled kernels")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pool(
    lengths: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> PagedKV:
    """Keys and values in blocks, each sequence's blocks scattered over the pool (a spare block
    between them all), its table padded with -1 past what it uses."""
    generator = torch.Generator().manual_seed(seed)
    used = [-(-length // block_size) for length in lengths]
    num_blocks = sum(used) + 3
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.full((len(lengths), max(used) + 1), -1, dtype=torch.int32)
    taken = 0
    for b, count in enumerate(used):
        tables[b, :count] = order[taken : taken + count]
        taken += count
    return PagedKV(keys, values, tables, torch.tensor(lengths, dtype=torch.int32))


def _gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's [kv_heads, length, d], contiguous."""
    block_size = pool.shape[1]
    return pool[table[: -(-length // block_size)].long()].flatten(0, 1)[:length].transpose(0, 1)


def _sdpa(q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
    """torch's SDPA on each sequence's keys and values gathered, in fp32, its query tokens the last."""
    out = torch.empty_like(q, dtype=torch.float32)
    q_tokens, head_dim = q.shape[1], q.shape[3]
    for b, length in enumerate(kv.lengths.tolist()):
        k, v = (_gather(pool, kv.block_tables[b], length).float()[None] for pool in (kv.keys, kv.values))
        mask = torch.ones(q_tokens, length, dtype=torch.bool).tril(length - q_tokens)
        query = q[b].transpose(0, 1)[None].float()
        attended = F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=head_dim**-0.5, enable_gqa=True
        )
        out[b] = attended[0].transpose(0, 1)
    return out


def _by_hand(q: torch.Tensor, kv: PagedKV, rules: AttentionRules) -> torch.Tensor:
    """Attention written out in float64, row by row, with transformers' eager rules for the
    window, the soft cap and the sinks."""
    q_tokens, heads = q.shape[1:3]
    groups = heads // kv.keys.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    for b, length in enumerate(kv.lengths.tolist()):
        k, v = (_gather(pool, kv.block_tables[b], length).double() for pool in (kv.keys, kv.values))
        for t in range(q_tokens):
            own = length - q_tokens + t
            seen = [p for p in range(length) if p <= own and (rules.window is None or p > own - rules.window)]
            for head in range(heads):
                scores = k[head // groups, seen] @ q[b, t, head].double() * rules.scale
                if rules.softcap is not None:
                    scores = torch.tanh(scores / rules.softcap) * rules.softcap
                if rules.sinks is not None:
                    scores = torch.cat((scores, rules.sinks[head : head + 1].double()))
                probs = torch.softmax(scores, dim=0)[: len(seen)]
                out[b, t, head] = probs @ v[head // groups, seen]
    return out


def _level(level: str) -> cpu_kernels.CpuKernels:
    loaded = cpu_kernels._load(level)
    assert loaded is not None and loaded.level == level
    return loaded


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequences_of_unlike_lengths_equal_sdpa_on_their_gathered_blocks(
    level: str, dtype: torch.dtype
) -> None:
    """Grouped heads (9 over 3), lengths of one position, inside a block, on and across its
    boundaries, and long enough that one sequence's positions are split between threads."""
    lengths = [1, 15, 16, 17, 300, 1001]
    kv = _pool(lengths, 16, 3, 64, dtype)
    q = torch.randn(len(lengths), 1, 9, 64)
    got = paged_attention(q, kv, AttentionRules(64**-0.5), kernels=_level(level))
    torch.testing.assert_close(got, _sdpa(q, kv), rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lengths", "block_size", "heads", "kv_heads", "head_dim"),
    [
        ([50], 64, 4, 4, 64),  # one block, every head its own KV head
        ([2000], 16, 9, 3, 64),  # one long sequence: its positions in spans over the threads
        ([7, 33, 129], 5, 8, 2, 20),  # a head width no vector divides, blocks of 5
        ([300, 1000], 32, 32, 8, 72),  # wide groups (Llama 1B's), a head width 8 past the vector
        ([70, 20], 16, 8, 1, 256),  # one KV head for all (multi-query), heads as wide as Gemma's
    ],
)
def test_shapes_equal_sdpa(level, dtype, lengths, block_size, heads, kv_heads, head_dim) -> None:
    kv = _pool(lengths, block_size, kv_heads, head_dim, dtype, seed=len(lengths))
    q = torch.randn(len(lengths), 1, heads, head_dim)
    got = paged_attention(q, kv, AttentionRules(head_dim**-0.5), kernels=_level(level))
    torch.testing.assert_close(got, _sdpa(q, kv), rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
def test_a_speculative_check_s_rows_each_see_up_to_their_own_position(level: str) -> None:
    kv = _pool([5, 40, 700], 16, 2, 64, torch.bfloat16)
    q = torch.randn(3, 5, 6, 64)  # five query tokens each: the first sequence's are all it holds
    got = paged_attention(q, kv, AttentionRules(64**-0.5), kernels=_level(level))
    torch.testing.assert_close(got, _sdpa(q, kv), rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks", "q_tokens"),
    [
        (37, None, False, 1),
        (37, None, False, 3),
        (None, 30.0, False, 1),
        (None, None, True, 2),
        (100, 20.0, True, 3),
    ],
)
def test_windows_soft_caps_and_sinks_equal_the_eager_rules(
    level, window, softcap, with_sinks, q_tokens
) -> None:
    kv = _pool([3, 64, 65, 600], 16, 2, 32, torch.float32, seed=3)
    q = torch.randn(4, q_tokens, 4, 32) * 3  # large scores: the cap bends them
    rules = AttentionRules(32**-0.5, window, softcap, torch.randn(4) if with_sinks else None)
    expected = _by_hand(q, kv, rules)
    got = paged_attention(q, kv, rules, kernels=_level(level))
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)
    torch.testing.assert_close(gathered_attention(q, kv, rules).double(), expected, rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
def test_a_sink_joins_once_when_a_sequence_is_split_between_threads(level: str) -> None:
    """One long sequence on 4 threads: its positions are split into spans, merged afterwards."""
    kv = _pool([1500], 16, 2, 32, torch.float32, seed=5)
    q, rules = torch.randn(1, 2, 4, 32) * 3, AttentionRules(32**-0.5, window=1200, sinks=torch.randn(4) + 2)
    expected = _by_hand(q, kv, rules)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = paged_attention(q, kv, rules, kernels=_level(level))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
def test_each_level_runs_when_chosen_by_its_variable(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV, level)
    assert cpu_kernels.kernels().level == level
    kv = _pool([33, 250], 16, 3, 64, torch.bfloat16)
    q = torch.randn(2, 1, 9, 64, dtype=torch.bfloat16)
    got = paged_attention(q, kv, AttentionRules(64**-0.5))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _sdpa(q, kv), rtol=0, atol=1e-2)


def test_what_the_kernel_does_not_take_falls_back_to_gathering(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp64 pool, a pool that is a view with gaps (not addressable in place), and no kernels
    at all (LLMCLI_CPU_KERNELS=off) each give the same answer by gathering."""
    kv, rules = _pool([20, 90], 16, 2, 16, torch.float64), AttentionRules(0.25)
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    expected = _by_hand(q, kv, rules)
    torch.testing.assert_close(paged_attention(q, kv, rules), expected, rtol=0, atol=1e-5)
    wide_keys, wide_values = (torch.cat((pool, pool), dim=-1).float() for pool in (kv.keys, kv.values))
    narrow = dataclasses.replace(kv, keys=wide_keys[..., :16], values=wide_values[..., :16])
    assert not narrow.keys.is_contiguous()
    torch.testing.assert_close(
        paged_attention(q.float(), narrow, rules).double(), expected, rtol=0, atol=1e-5
    )
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    as_fp32 = dataclasses.replace(kv, keys=kv.keys.float(), values=kv.values.float())
    torch.testing.assert_close(
        paged_attention(q.float(), as_fp32, rules).double(), expected, rtol=0, atol=1e-5
    )


@needs_kernels
def test_a_length_past_a_sequence_s_blocks_is_refused() -> None:
    kv, rules, q = _pool([20], 16, 1, 16, torch.float32), AttentionRules(0.25), torch.randn(1, 1, 1, 16)
    too_long = dataclasses.replace(kv, lengths=torch.tensor([40], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside the KV pool"):
        paged_attention(q, too_long, rules, kernels=_level(LEVELS[0]))
    kv.block_tables[0, 1] = 999  # a block id past the pool's
    with pytest.raises(ValueError, match="outside the KV pool"):
        paged_attention(q, kv, rules, kernels=_level(LEVELS[0]))
