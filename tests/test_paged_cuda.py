"""The GPU's paged decode attention (engine/native/paged_cuda.py) against attention written out
in float64 over the same blocks gathered: on the GPU where there is one, else on CPU tensors
under Triton's interpreter (CI). Shapes stay small for the interpreter but cross every boundary:
lengths of one position, at and one past a block's end, tiles that span blocks, grouped heads
that are no power of two, head widths the kernel pads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmcli.engine.native import paged_cuda
from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV
from llmcli.engine.native.paged_cuda import kernel_takes, paged_attention
from test_paged_attention import _by_hand, _pool
from triton_kernels import kernel_device

DTYPES = [torch.float32, torch.bfloat16]


def _seeded(seed: int) -> torch.Generator:
    """Each case's own inputs, whatever ran before it."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def device() -> torch.device:
    return kernel_device()


def _on(kv: PagedKV, device: torch.device) -> PagedKV:
    return PagedKV(*(t.to(device) for t in (kv.keys, kv.values, kv.block_tables, kv.lengths)))


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: the order of summation. bf16: the output's own rounding, one unit in its last place
    (8 bits: relative 2⁻⁷), as Triton's interpreter rounds to bf16 toward zero (a GPU to nearest)."""
    return {"rtol": 0, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-3}


def _check(q: torch.Tensor, kv: PagedKV, rules: AttentionRules, device: torch.device) -> None:
    """The kernel (it must take these shapes) against the float64 reference, in q's dtype."""
    on_device = _on(kv, device)
    q_device = q.to(device)
    assert kernel_takes(q_device, on_device)
    got = paged_attention(q_device, on_device, rules)
    assert got.shape == q.shape and got.dtype == q.dtype
    expected = _by_hand(q, kv, rules)
    torch.testing.assert_close(got.cpu().double(), expected, **_tolerance(q.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80, 96])
def test_sequences_of_unlike_lengths_across_block_boundaries(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> None:
    """Six query heads over two KV heads (groups of 3, padded to 4); one position, a block less
    one, a block exactly, one past it, and several blocks (tiles spanning them)."""
    kv = _pool([1, 15, 16, 17, 40], 16, 2, head_dim, dtype, seed=head_dim)
    q = torch.randn(5, 1, 6, head_dim, generator=_seeded(1)).to(dtype)
    _check(q, kv, AttentionRules(head_dim**-0.5), device)


@pytest.mark.parametrize(
    ("lengths", "block_size", "heads", "kv_heads", "head_dim"),
    [
        ([50], 64, 4, 4, 32),  # one block, every head its own KV head
        ([7, 33, 70], 5, 8, 2, 20),  # blocks of 5: a tile spans several; a width no power of two
        ([9, 30], 1, 2, 1, 16),  # blocks of one position
        ([70, 20], 16, 8, 1, 64),  # one KV head for all (multi-query)
        ([16, 32, 48], 16, 3, 3, 16),  # every length a whole number of blocks
    ],
)
def test_shapes(device, lengths, block_size, heads, kv_heads, head_dim) -> None:
    kv = _pool(lengths, block_size, kv_heads, head_dim, torch.float32, seed=len(lengths))
    q = torch.randn(len(lengths), 1, heads, head_dim, generator=_seeded(5))
    _check(q, kv, AttentionRules(0.3), device)  # a scale that is not 1/√d


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_speculative_check_s_rows_each_see_up_to_their_own_position(
    device: torch.device, dtype: torch.dtype
) -> None:
    kv = _pool([4, 17, 45], 16, 2, 32, dtype, seed=2)
    q = torch.randn(3, 4, 4, 32, generator=_seeded(6)).to(
        dtype
    )  # four query tokens: the first sequence's are all it holds
    _check(q, kv, AttentionRules(32**-0.5), device)


# The sinks, where a case has them, are one logit per query head.
_SINKS = torch.randn(4, generator=_seeded(4))


@pytest.mark.parametrize(
    ("rules", "q_tokens"),
    [
        (AttentionRules(32**-0.5, window=7), 1),
        (AttentionRules(32**-0.5, window=7), 3),
        (AttentionRules(32**-0.5, window=16), 1),  # a window of exactly a block
        (AttentionRules(32**-0.5, softcap=30.0), 1),
        (AttentionRules(32**-0.5, sinks=_SINKS), 2),
        (AttentionRules(32**-0.5, window=20, softcap=5.0, sinks=_SINKS), 3),
    ],
    ids=lambda value: (
        "" if isinstance(value, int) else f"w{value.window}-c{value.softcap}-s{value.sinks is not None}"
    ),
)
def test_windows_soft_caps_and_sinks_equal_the_eager_rules(
    device: torch.device, rules: AttentionRules, q_tokens: int
) -> None:
    kv = _pool([3, 16, 17, 60], 16, 2, 32, torch.float32, seed=3)
    q = torch.randn(4, q_tokens, 4, 32, generator=_seeded(7)) * 3  # large scores: the cap bends them
    _check(q, kv, rules, device)


def test_a_sequence_of_length_zero_gives_zeros_beside_the_others(device: torch.device) -> None:
    """A padded row of a graphed batch holds nothing: its output is zeros, not NaN, and the
    rows beside it are unchanged."""
    kv = _pool([1, 20], 16, 1, 16, torch.float32, seed=6)
    padded = dataclasses.replace(kv, lengths=torch.tensor([0, 20], dtype=torch.int32))
    q = torch.randn(2, 1, 2, 16, generator=_seeded(8))
    got = paged_attention(q.to(device), _on(padded, device), AttentionRules(0.25)).cpu()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    expected = _by_hand(
        q[1:],
        dataclasses.replace(kv, block_tables=kv.block_tables[1:], lengths=kv.lengths[1:]),
        AttentionRules(0.25),
    )
    torch.testing.assert_close(got[1:].double(), expected, rtol=0, atol=2e-5)


def test_what_the_kernel_does_not_take_falls_back_to_gathering(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp64 pool, a pool whose head dimension is strided, and wider heads than the kernel's
    registers hold each give the float64 reference's answer by gathering."""
    rules = AttentionRules(0.25)
    kv = _pool([20, 40], 16, 2, 16, torch.float64)
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64, generator=_seeded(9))
    assert not kernel_takes(q.to(device), _on(kv, device))
    got = paged_attention(q.to(device), _on(kv, device), rules).cpu()
    torch.testing.assert_close(got, _by_hand(q, kv, rules), rtol=0, atol=2e-5)
    keys, values = (torch.stack((pool, pool), dim=-1).float() for pool in (kv.keys, kv.values))
    strided = dataclasses.replace(kv, keys=keys[..., 0], values=values[..., 0])  # head dim stride 2
    assert strided.keys.stride(3) == 2 and not kernel_takes(q.float().to(device), _on(strided, device))
    got = paged_attention(q.float().to(device), _on(strided, device), rules).cpu()
    torch.testing.assert_close(got.double(), _by_hand(q, kv, rules), rtol=0, atol=2e-5)
    monkeypatch.setattr(paged_cuda, "MAX_HEAD_DIM", 8)  # the widest the kernel takes, lowered
    narrow = _pool([20], 16, 1, 16, torch.float32)
    query = torch.randn(1, 1, 1, 16, generator=_seeded(10))
    assert not kernel_takes(query.to(device), _on(narrow, device))
    got = paged_attention(query.to(device), _on(narrow, device), rules).cpu()
    torch.testing.assert_close(got.double(), _by_hand(query, narrow, rules), rtol=0, atol=2e-5)


def test_cpu_tensors_without_the_interpreter_are_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU where Triton is not interpreting, the kernel cannot run: gathering answers."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv, rules = _pool([20], 16, 1, 16, torch.float32), AttentionRules(0.25)
    q = torch.randn(1, 1, 2, 16, generator=_seeded(11))
    assert not kernel_takes(q, kv)
    torch.testing.assert_close(
        paged_attention(q, kv, rules).double(), _by_hand(q, kv, rules), rtol=0, atol=2e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_on_a_gpu_llama_8b_shapes_and_a_graph_replayed_on_new_tables(dtype: torch.dtype) -> None:
    """Llama-8B's heads (32 over 8, d = 128), long sequences, against the gathering path; then
    the kernel captured in a CUDA graph and replayed after the tables and lengths changed in
    place, as a graphed decode step replays it."""
    rules = AttentionRules(128**-0.5)
    kv = _on(_pool([1, 300, 4097, 8192], 16, 8, 128, dtype), torch.device("cuda"))
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=dtype)
    reference = paged_cuda.gathered_attention(q, kv, rules)
    torch.testing.assert_close(paged_attention(q, kv, rules).float(), reference.float(), rtol=0, atol=1e-2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        paged_attention(q, kv, rules)  # compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, kv, rules)
    kv.lengths.copy_(torch.tensor([8000, 1, 300, 4097], dtype=torch.int32))  # within the rolled tables
    kv.block_tables.copy_(kv.block_tables.roll(1, dims=0))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(
        out.float(), paged_cuda.gathered_attention(q, kv, rules).float(), rtol=0, atol=1e-2
    )
