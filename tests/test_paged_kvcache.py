"""The native engine over a paged KV cache (engine/native/paged_kvcache.py) against the same
engine over its contiguous cache, on tiny random models in fp32: the same greedy tokens, and
logits within rounding, for one sequence and for sequences that share their first blocks."""

from __future__ import annotations

import pytest
import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.loop import Engine
from llmcli.engine.native import paged_cpu, paged_cuda
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.blocks import OutOfBlocks
from llmcli.engine.native.paged_backend import PagedBackend
from llmcli.engine.native.paged_kvcache import PagedStore
from llmcli.engine.native.paged_step import PagedSteps, decode_sequences
from llmcli.errors import KVMemoryFull, LlmcliError
from test_native import CASES, CONTEXT, build, prompt
from triton_kernels import kernel_device

BLOCK = 16


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return build(*CASES["llama-gqa2"])


def _store(backend: NativeBackend, blocks: int = 64) -> PagedStore:
    return PagedStore.for_net(backend.net, blocks, BLOCK)


def _greedy(backend: NativeBackend, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy tokens after `ids` and the logits each was taken from."""
    logits = [backend.prefill(ids)]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(backend.decode(torch.tensor([tokens[-1]], device=backend.device)))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def _same(paged: list[torch.Tensor], contiguous: list[torch.Tensor], atol: float = 1e-5) -> None:
    for ours, theirs in zip(paged, contiguous, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "case", ["llama-gqa2", "qwen3-qk-norm", "gemma3-window-8-shorter-than-the-prompt", "gpt-oss-k2-window-8"]
)
@torch.inference_mode()
def test_greedy_tokens_equal_the_contiguous_cache_s(case: str) -> None:
    """A 37-token prompt (two blocks and five positions) and 40 steps, across two block ends;
    sliding windows (attention masked, every position kept) and sinks included."""
    model = build(*CASES[case])
    contiguous = NativeBackend(model, CONTEXT)
    paged = PagedBackend(None, CONTEXT, net=contiguous.net, store=_store(contiguous))
    ids = prompt(37, seed=7)
    expected, expected_logits = _greedy(contiguous, ids, 40)
    tokens, logits = _greedy(paged, ids, 40)
    assert tokens == expected and len(set(expected)) > 5
    _same(logits, expected_logits)
    assert len(paged.cache.table.blocks) == -(-(37 + 39) // BLOCK)


@torch.inference_mode()
def test_two_sequences_sharing_a_prompt_s_head_share_its_blocks_and_each_equal_it_alone(llama) -> None:
    """The second sequence's prompt starts with the first's 40 tokens: it holds the first's two
    full blocks (computed once) and prefills the rest; both go on decoding, each equal to a
    contiguous cache's sequence alone, the shared blocks unchanged by either."""
    alone = [NativeBackend(llama, CONTEXT) for _ in range(2)]
    store = _store(alone[0])
    paged = [PagedBackend(None, CONTEXT, net=alone[0].net, store=store) for _ in range(2)]
    head = prompt(40, seed=8)
    prompts = [head, head + prompt(13, seed=9)]
    first, _ = _greedy(paged[0], prompts[0], 6)
    expected, _ = _greedy(alone[0], prompts[0], 6)
    assert first == expected
    second_logits = paged[1].prefill(prompts[1])
    torch.testing.assert_close(second_logits, alone[1].prefill(prompts[1]), rtol=0, atol=1e-5)
    assert paged[1].cache.table.blocks[:2] == paged[0].cache.table.blocks[:2]
    assert [store.blocks.refs(block) for block in paged[0].cache.table.blocks[:2]] == [2, 2]
    tokens = [first[-1], int(second_logits.argmax())]
    for _ in range(20):  # the two in turn, past the next block ends
        for sequence in (0, 1):
            step = torch.tensor([tokens[sequence]])
            ours, theirs = paged[sequence].decode(step), alone[sequence].decode(step)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
            assert int(ours.argmax()) == int(theirs.argmax())
            tokens[sequence] = int(theirs.argmax())


@torch.inference_mode()
def test_a_released_prompt_s_blocks_are_found_by_the_next_request(llama) -> None:
    contiguous = NativeBackend(llama, CONTEXT)
    store = _store(contiguous)
    ids = prompt(50, seed=10)
    earlier = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    earlier.prefill(ids)
    held = list(earlier.cache.table.blocks[:3])
    earlier.cache.release()
    assert sorted(store.blocks.kept()) == sorted(held)
    later = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    expected, expected_logits = _greedy(contiguous, ids, 12)
    tokens, logits = _greedy(later, ids, 12)
    assert later.cache.table.blocks[:3] == held and tokens == expected
    _same(logits, expected_logits)


@torch.inference_mode()
def test_a_check_pass_a_crop_and_a_new_turn_equal_the_contiguous_cache_s(llama) -> None:
    """Speculation's check (rows scored after the cache, then cropped back), chat's /undo into
    a shared block (copied before it is written) and a turn after it."""
    contiguous = NativeBackend(llama, CONTEXT)
    store = _store(contiguous)
    paged = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    ids = prompt(70, seed=11)
    for backend in (contiguous, paged):
        backend.prefill(ids[:40])
    torch.testing.assert_close(paged.score(ids[40:47]), contiguous.score(ids[40:47]), rtol=0, atol=1e-5)
    published = paged.cache.table.blocks[1]  # positions 16-31, published with the prefill
    for backend in (contiguous, paged):
        backend.crop(20)
    assert paged.length == 20
    torch.testing.assert_close(paged.prefill(ids[20:70]), contiguous.prefill(ids[20:70]), rtol=0, atol=1e-5)
    assert paged.cache.table.blocks[1] != published  # written after the crop: a copy
    again = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    assert again.cache.share_prefix(ids[:40]) == 32  # the original still shared


@torch.inference_mode()
def test_an_engine_s_earlier_text_comes_back_from_the_pool_s_kept_blocks(llama) -> None:
    """An engine (the loop and its prefix store, unchanged) on a paged cache: a prompt, then
    another that keeps only its first block, then the first again: its later blocks, kept in
    the pool since the crop, are held again rather than computed, and every reply equals a
    contiguous cache's engine's."""
    contiguous = NativeBackend(llama, CONTEXT)
    paged = PagedBackend(None, CONTEXT, net=contiguous.net, store=_store(contiguous))
    engines = [Engine(backend, frozenset(), CONTEXT) for backend in (paged, contiguous)]
    first, other = prompt(50, seed=16), prompt(50, seed=16)[:16] + prompt(30, seed=17)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    blocks = []
    for ids in (first, other, first):
        replies = [engine.generate(ids, params, None) for engine in engines]
        for reply in replies:
            list(reply)
        assert replies[0].result.token_ids == replies[1].result.token_ids
        blocks.append(list(paged.cache.table.blocks))
    assert blocks[2][:3] == blocks[0][:3] and blocks[1][1] != blocks[0][1]


@torch.inference_mode()
def test_positions_an_image_moved_are_the_decode_step_s_rope_positions_as_on_the_contiguous_cache(
    llama,
) -> None:
    """After an image whose rows span fewer RoPE positions than rows (Qwen's multimodal RoPE),
    text positions move back (KVCache.shifts): the paged step rotates by the moved ones."""
    contiguous = NativeBackend(llama, CONTEXT)
    paged = PagedBackend(None, CONTEXT, net=contiguous.net, store=_store(contiguous))
    ids = prompt(20, seed=21)
    for backend in (contiguous, paged):
        backend.prefill(ids)
        backend.cache.shift_from(20, -6)
    assert paged.cache.rope_shift == -6
    for token in prompt(4, seed=22):
        step = torch.tensor([token])
        torch.testing.assert_close(paged.decode(step), contiguous.decode(step), rtol=0, atol=1e-5)


@torch.inference_mode()
def test_save_restore_and_copy_prefix_hold_what_the_contiguous_cache_holds(llama) -> None:
    """The prefix store's three ways of bringing a text back: a host copy restored (the same
    SavedCache the contiguous cache saves), and another sequence's head copied (its blocks
    held, not copied)."""
    contiguous = NativeBackend(llama, CONTEXT)
    store = _store(contiguous)
    paged = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    ids = prompt(45, seed=12)
    contiguous.prefill(ids)
    paged.prefill(ids)
    saved = paged.save()
    expected = contiguous.save()
    assert saved.length == expected.length == 45
    for ours, theirs in zip(saved.keys + saved.values, expected.keys + expected.values, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    restored = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    restored.restore(expected)  # the contiguous cache's copy into blocks
    step = torch.tensor([3])
    reference = contiguous.decode(step)
    torch.testing.assert_close(restored.decode(step), reference, rtol=0, atol=1e-5)
    copied = PagedBackend(None, CONTEXT, net=contiguous.net, store=store)
    assert copied.copy_prefix(paged, 45) == 45
    assert copied.cache.table.blocks == paged.cache.table.blocks
    torch.testing.assert_close(copied.decode(step), reference, rtol=0, atol=1e-5)
    assert copied.cache.table.blocks[2] != paged.cache.table.blocks[2]  # the partial block copied
    assert copied.copy_prefix(contiguous, 45) == 0  # another kind of cache: prefilled instead


@torch.inference_mode()
def test_a_pool_too_small_refuses_before_anything_changes_and_an_engine_generates_within_it(llama) -> None:
    contiguous = NativeBackend(llama, CONTEXT)
    paged = PagedBackend(None, CONTEXT, net=contiguous.net, store=_store(contiguous, blocks=3))
    with pytest.raises(OutOfBlocks) as raised:
        paged.prefill(prompt(49, seed=13))  # four blocks
    assert isinstance(raised.value, KVMemoryFull) and paged.length == 0
    assert paged.store.blocks.available() == 3
    engine = Engine(paged, frozenset(), CONTEXT)
    reference = Engine(contiguous, frozenset(), CONTEXT)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    ours, theirs = (
        engine.generate(prompt(20, seed=14), params, None),
        reference.generate(prompt(20, seed=14), params, None),
    )
    list(ours), list(theirs)
    assert ours.result.token_ids == theirs.result.token_ids


def test_a_model_with_recurrent_layers_is_refused_in_one_line() -> None:
    model = build("qwen3_5_text", {"num_hidden_layers": 4})  # linear-attention layers among them
    with pytest.raises(LlmcliError, match="recurrent or shared-KV layers"):
        PagedBackend(model, CONTEXT)


@torch.inference_mode()
def test_a_step_that_runs_out_of_blocks_preempts_one_sequence_and_the_other_goes_on(llama) -> None:
    """Two sequences of a full block each in a pool of three: their next step needs two more.
    The step raises before anything is written; the newest sequence is let go (preempted), and
    the other's step, retried with another token, equals its contiguous twin's, its block keyed
    by the token it was given last."""
    alone = NativeBackend(llama, CONTEXT)
    store = _store(alone, blocks=3)
    paged = [PagedBackend(None, CONTEXT, net=alone.net, store=store) for _ in range(2)]
    ids = prompt(16, seed=15)
    first = alone.prefill(ids)
    for backend, tail in zip(paged, ([], [1]), strict=True):
        backend.prefill(ids[: 16 - len(tail)] + tail)
    with pytest.raises(OutOfBlocks):
        decode_sequences(alone.net, torch.tensor([5, 6]), [backend.cache for backend in paged])
    assert [backend.length for backend in paged] == [16, 16]
    paged[1].cache.release()  # preempted: requeued by the scheduler, its blocks free
    token = int(first.argmax())
    assert token != 5
    rows = decode_sequences(alone.net, torch.tensor([token]), [paged[0].cache])
    torch.testing.assert_close(rows, alone.decode(torch.tensor([token])), rtol=0, atol=5e-5)
    assert paged[0].cache.table.tokens == [*ids, token]


@torch.inference_mode()
def test_room_a_failed_step_left_is_not_shared_when_another_sequence_copies_the_text(llama) -> None:
    """A step given a sequence room for its 16th token, then failing on another's: a copy of
    the sequence's text made after it publishes no block holding that unwritten position."""
    alone = NativeBackend(llama, CONTEXT)
    store = _store(alone, blocks=2)
    paged = [PagedBackend(None, CONTEXT, net=alone.net, store=store) for _ in range(3)]
    ids = prompt(16, seed=18)
    paged[0].prefill(ids[:15])
    paged[1].prefill(prompt(16, seed=19))  # the second block: the pool is full
    with pytest.raises(OutOfBlocks):
        decode_sequences(alone.net, torch.tensor([ids[15], 1]), [paged[0].cache, paged[1].cache])
    assert paged[2].copy_prefix(paged[0], 15) == 15
    assert store.blocks.share_prefix([*ids, 0]).length == 0


# The decode step's attention read in place, each way it can be: torch's gathering (the
# reference), llmcli's compiled CPU kernel (paged_cpu), the Triton kernel (paged_cuda: on CPU
# tensors under Triton's interpreter here).
KERNELS = {
    "gathered": paged_cpu.gathered_attention,
    "compiled": paged_cpu.paged_attention,
    "triton": paged_cuda.paged_attention,
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", ["llama-gqa2", "gpt-oss-k2-window-8"])
@torch.inference_mode()
def test_a_batched_step_over_unlike_lengths_reads_the_blocks_in_place_each_row_as_alone(
    case: str, kernel: str
) -> None:
    """Three sequences (5, 16 and 33 tokens: inside a block, at its end, one past two) decoded in
    one step per token, one kernel call per layer; every row's logits as the same sequence's on
    a contiguous cache alone, token after token (sinks and a window of 8 in gpt-oss)."""
    if kernel == "triton" and kernel_device().type == "cuda":
        pytest.skip("CPU tensors are gathered where Triton is not interpreting: the GPU test runs it")
    model = build(*CASES[case])
    alone = [NativeBackend(model, CONTEXT) for _ in range(3)]
    store = _store(alone[0])
    paged = [PagedBackend(None, CONTEXT, net=alone[0].net, store=store) for _ in range(3)]
    prompts = [prompt(length, seed=20 + length) for length in (5, 16, 33)]
    firsts = [backend.prefill(ids) for backend, ids in zip(alone, prompts, strict=True)]
    _same([backend.prefill(ids) for backend, ids in zip(paged, prompts, strict=True)], firsts)
    tokens = [int(logits.argmax()) for logits in firsts]
    for _ in range(14):
        caches = [backend.cache for backend in paged]
        rows = decode_sequences(alone[0].net, torch.tensor(tokens), caches, KERNELS[kernel])
        for sequence in range(3):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            torch.testing.assert_close(rows[sequence : sequence + 1], expected, rtol=0, atol=5e-5)
            tokens[sequence] = int(expected.argmax())
            assert int(rows[sequence].argmax()) == tokens[sequence]
    assert [backend.length for backend in paged] == [5 + 14, 16 + 14, 33 + 14]


def _fixed_shape_steps(graphs: bool, device: str, atol: float) -> PagedSteps:
    """Three sequences (5, 16 and 33 tokens) decoded by PagedSteps, padded to four rows (the
    fourth writes and reads the scratch block), then two after the second leaves: every row as
    the same sequence decoded alone on a contiguous cache."""
    model = build(*CASES["gpt-oss-k2-window-8"]).to(device)
    alone = [NativeBackend(model, CONTEXT) for _ in range(3)]
    store = _store(alone[0])
    paged = [PagedBackend(None, CONTEXT, net=alone[0].net, store=store) for _ in range(3)]
    steps = PagedSteps(alone[0].net, store, CONTEXT, graphs=graphs)
    prompts = [prompt(length, seed=40 + length) for length in (5, 16, 33)]
    tokens = [int(backend.prefill(ids).argmax()) for backend, ids in zip(alone, prompts, strict=True)]
    for backend, ids in zip(paged, prompts, strict=True):
        backend.prefill(ids)
    for step in range(12):
        going = [0, 1, 2] if step < 6 else [0, 2]
        rows = steps.decode([tokens[s] for s in going], [paged[s].cache for s in going])
        for row, sequence in enumerate(going):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]], device=device))
            torch.testing.assert_close(rows[row : row + 1], expected, rtol=0, atol=atol)
            tokens[sequence] = int(expected.argmax())
    assert [backend.length for backend in paged] == [5 + 12, 16 + 6, 33 + 12]
    return steps


@torch.inference_mode()
def test_fixed_shape_steps_padded_to_a_batch_size_equal_each_sequence_alone() -> None:
    """The step a CUDA graph replays, run eagerly: its inputs in fixed buffers, padded rows."""
    _fixed_shape_steps(graphs=False, device="cpu", atol=5e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_a_gpu_graphed_paged_steps_equal_each_sequence_alone_one_graph_per_batch_size() -> None:
    steps = _fixed_shape_steps(graphs=True, device="cuda", atol=1e-4)
    assert steps.graphs is not None and steps.graphs.captures == 2  # four rows, then two


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_a_gpu_the_paged_engine_s_greedy_tokens_equal_the_contiguous_one_s() -> None:
    """On cuda, fp32: the decode step through the Triton kernel, replayed from a CUDA graph,
    two sequences sharing a head."""
    model = build(*CASES["llama-gqa2"]).to("cuda")
    alone = [NativeBackend(model, CONTEXT) for _ in range(2)]
    store = _store(alone[0])
    assert store.device.type == "cuda"
    paged = [PagedBackend(None, CONTEXT, net=alone[0].net, store=store, graphs=True) for _ in range(2)]
    head = prompt(40, seed=30)
    for sequence, ids in enumerate((head, head + prompt(9, seed=31))):
        expected, expected_logits = _greedy(alone[sequence], ids, 30)
        tokens, logits = _greedy(paged[sequence], ids, 30)
        assert tokens == expected
        _same(logits, expected_logits, atol=1e-4)  # cuda's SDPA may pick another kernel per layout
    assert paged[1].cache.table.blocks[:2] == paged[0].cache.table.blocks[:2]
