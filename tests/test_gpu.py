"""What only a GPU can show. Skipped without CUDA (CI never has one); run with `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.models.load import load_model
from llmcli.models.resolve import ResolvedModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Recorder:
    """Collects what a chat shows, for assertions."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.replies: list[str] = []

    def reply_start(self) -> None: ...
    def reasoning_piece(self, text: str) -> None: ...
    def reply_piece(self, text: str) -> None: ...
    def reply_end(self, result, turn) -> None:
        self.replies.append(turn.reply)

    def info(self, text: str) -> None: ...
    def notice(self, text: str) -> None: ...
    def error(self, text: str) -> None:
        self.errors.append(text)


def fill_device_memory() -> list[torch.Tensor]:
    """Take every byte the allocator can get, in shrinking blocks, so the next allocation fails."""
    hogs: list[torch.Tensor] = []
    block = 1 << 30
    while block >= 1 << 16:
        try:
            hogs.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            block //= 2
    return hogs


@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_out_of_memory_in_a_chat_turn_keeps_the_chat(tiny_llama: Path, engine: str) -> None:
    from llmcli.config.settings import SamplingSettings
    from llmcli.frontends.chat_session import ChatSession
    from llmcli.frontends.local import InProcessTarget

    settings = LoadSettings(device="cuda", engine=engine)
    loaded = load_model(ResolvedModel(name="tiny", path=tiny_llama, source="folder"), settings)
    view = Recorder()
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=8)
    session = ChatSession(InProcessTarget(loaded, None, settings), view, sampling=greedy)
    history = session.history
    assert session.turn("Hello there") is not None
    before = (list(history.conversation.messages), list(history.conversation.ids))
    message = "word " * 100  # fits the 1024-token context (about 400 tokens), not the memory
    assert len(loaded.tokenizer(message)["input_ids"]) + len(before[1]) < loaded.context_length // 2
    hogs = fill_device_memory()
    try:
        assert session.turn(message) is None
    finally:
        del hogs
        torch.cuda.empty_cache()
    assert view.errors and "out of memory" in view.errors[-1], view.errors
    assert (history.conversation.messages, history.conversation.ids) == before
    assert len(history.engine.cached_ids) == history.engine.backend.length
    assert session.turn("Still there?") is not None


def fp32_engines(tiny_llama: Path):
    """Token identity is checked in fp32: in bf16 the top two logits of a random tiny model tie."""
    import dataclasses

    from llmcli.engine.loop import Engine

    resolved = ResolvedModel(name="tiny", path=tiny_llama, source="folder")
    loaded = dataclasses.replace(
        load_model(resolved, LoadSettings(device="cuda", dtype="fp32")), eos_token_ids=frozenset()
    )
    reference = Engine.for_loaded(dataclasses.replace(loaded, engine="transformers", fast=False))
    return loaded, reference


def run_three_times(engine, ids, params):
    runs = []
    for _ in range(3):  # the later runs replay graphs captured in the first
        engine.reset()
        generation = engine.generate(ids, params, None)
        list(generation)
        runs.append(generation)
    return runs


def test_native_cuda_graphs_equal_the_eager_transformers_path(tiny_llama: Path) -> None:
    import dataclasses

    from llmcli.engine.loop import Engine

    loaded, reference = fp32_engines(tiny_llama)
    native = Engine.for_loaded(dataclasses.replace(loaded, engine="native"))  # fast by default on CUDA
    assert native.backend.captures_graphs
    assert native.warm_up() > 0
    # A prompt that crosses the first length bucket mid-reply: a second graph, and the cache grows.
    ids = torch.randint(3, 300, (230,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    expected = run_three_times(reference, ids, params)[0]
    for got in run_three_times(native, ids, params):
        assert got.result.token_ids == expected.result.token_ids
        torch.testing.assert_close(got.prefill_logits, expected.prefill_logits, rtol=0, atol=1e-4)
    assert native.backend.graphs.captures >= 2


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_native_graph_replay_equals_its_eager_step_in_bf16(tiny_llama: Path, quant: str) -> None:
    """In bf16, logits within tolerance (tokens may differ where the top two tie exactly); with
    int4, the natively quantized layers replay in the graphs too."""
    from llmcli.engine.native.backend import NativeBackend

    resolved = ResolvedModel(name="tiny", path=tiny_llama, source="folder")
    loaded = load_model(resolved, LoadSettings(device="cuda", quant=quant))
    assert loaded.quant_backend == ("native" if quant == "int4" else "none")
    graphed = NativeBackend(loaded.model, loaded.context_length, graphs=True)
    eager = NativeBackend(loaded.model, loaded.context_length, static_shapes=True)
    ids = list(range(3, 40))
    graphed.prefill(ids)
    eager.prefill(ids)
    for token in range(40, 60):
        step = torch.tensor([token], device="cuda")
        torch.testing.assert_close(graphed.decode(step), eager.decode(step), rtol=2e-2, atol=2e-2)


def test_transformers_compiled_decode_equals_the_dynamic_path(tiny_llama: Path) -> None:
    import dataclasses

    from llmcli.engine.loop import Engine

    loaded, reference = fp32_engines(tiny_llama)
    compiled = Engine.for_loaded(dataclasses.replace(loaded, engine="transformers", fast=True))
    assert compiled.backend.captures_graphs and compiled.warm_up() > 0
    ids = list(range(3, 20))
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    expected = run_three_times(reference, ids, params)[0]
    for got in run_three_times(compiled, ids, params):
        assert got.result.token_ids == expected.result.token_ids


# decode, a short check, the largest check (the few-rows kernels), one more (dequantized), a prefill chunk
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("kind", ["int8", "int4", "int4-tinygemm"])
def test_quantized_kernels_on_cuda_match_their_weights_and_replay_in_a_graph(
    kind: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmcli.models.quantized import QuantizedLinear

    monkeypatch.setenv("LLMCLI_INT4_CUDA", "tinygemm" if kind == "int4-tinygemm" else "triton")
    kind = kind.removesuffix("-tinygemm")
    torch.manual_seed(0)
    out_features = 516 if kind == "int8" else 520  # int8: a ragged last block of channels
    weight = torch.randn(out_features, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    layer = QuantizedLinear.int8(weight, None) if kind == "int8" else QuantizedLinear.int4(weight, None, 128)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    reference = x.float() @ layer.dequantized().t()
    assert ((eager.float() - reference).norm() / reference.norm()).item() < 2e-2
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    layer(static_x)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out = layer(static_x)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["experts-out-in", "experts-in-out"])  # Qwen3-MoE, gpt-oss
@pytest.mark.parametrize("shared_input", [True, False])  # gate/up: one token; down: one per expert
def test_gathered_expert_products_read_the_chosen_experts_and_replay_in_a_graph(
    dtype: torch.dtype, layout: str, shared_input: bool
) -> None:
    from llmcli.engine.native.gathered_cuda import gathered_matvec

    torch.manual_seed(0)
    experts, n, k, slots = 16, 300, 520, 4  # ragged against the kernel's blocks on both sides
    stored = torch.randn(experts, n, k, device="cuda", dtype=dtype)
    stacked = stored if layout == "experts-out-in" else stored.transpose(1, 2).contiguous().transpose(1, 2)
    x = torch.randn(k if shared_input else (slots, k), device="cuda", dtype=dtype)
    chosen = torch.tensor([3, 15, 0, 7], device="cuda")

    def reference() -> torch.Tensor:
        inputs = x.float().expand(slots, -1).unsqueeze(-1)
        return torch.matmul(stacked.float().index_select(0, chosen), inputs).squeeze(-1)

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    eager = gathered_matvec(stacked, chosen, x)
    assert eager.shape == (slots, n) and eager.dtype == dtype
    torch.testing.assert_close(eager.float(), reference(), rtol=tolerance, atol=tolerance)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gathered_matvec(stacked, chosen, x)
    chosen.copy_(torch.tensor([9, 9, 1, 14]))  # other experts, read by the same replay
    graph.replay()
    torch.testing.assert_close(out.float(), reference(), rtol=tolerance, atol=tolerance)


REPEATING = "the cat sat on the mat, and the dog sat on the log; "


@pytest.mark.parametrize("kind", ["lookup", "self", "other"])
def test_speculation_with_cuda_graphs_keeps_the_greedy_output(
    tiny_llama: Path, tiny_qwen2: Path, kind: str
) -> None:
    """Drafts checked by the eager check pass between graph replays (and, for a draft model, its
    own engine replaying its own graphs): the tokens of transformers' eager path, across a
    length bucket, and a cache that holds exactly the tokens it says."""
    import dataclasses

    from llmcli.engine.loop import Engine
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.speculative.drafters import LookupDrafter, ModelDrafter
    from llmcli.engine.speculative.schedule import DraftLength

    loaded, reference = fp32_engines(tiny_llama)
    native = Engine.for_loaded(dataclasses.replace(loaded, engine="native"))
    assert native.backend.captures_graphs and native.warm_up() > 0
    drafter: object = LookupDrafter()
    if kind != "lookup":
        source = loaded if kind == "self" else fp32_engines(tiny_qwen2)[0]
        drafting = Engine.for_loaded(dataclasses.replace(source, engine="native"))
        drafting.warm_up()
        drafter = ModelDrafter(drafting, kind)
    native.speculation = Speculation(drafter, DraftLength(6))  # fixed: drafts are always checked
    ids = loaded.tokenizer(REPEATING * 40)["input_ids"][:230]
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    expected = run_three_times(reference, ids, params)[0]
    for got in run_three_times(native, ids, params):
        assert got.result.token_ids == expected.result.token_ids
        assert native.backend.length == len(native.cached_ids)
        assert native.cached_ids == ids + got.result.token_ids[:-1]
        drafts = got.result.stats.speculative
        assert drafts is not None and drafts.drafted > 0
        if kind == "self":  # the same weights, through other graphs: near-ties may still differ
            assert drafts.accepted >= 0.9 * drafts.drafted
    assert native.backend.graphs.captures >= 3  # the decode step's and the check passes' shapes


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_check_pass_equals_decode_steps_on_cuda(tiny_llama: Path, quant: str) -> None:
    """What the check pass computes for K drafted tokens is what K graph-replayed decode steps
    compute, in bf16 (within tolerance) and through the int4 kernels."""
    from llmcli.engine.native.backend import NativeBackend

    resolved = ResolvedModel(name="tiny", path=tiny_llama, source="folder")
    loaded = load_model(resolved, LoadSettings(device="cuda", quant=quant))
    backend = NativeBackend(loaded.model, loaded.context_length, graphs=True)
    ids = list(range(3, 40))
    drafts = list(range(40, 46))
    backend.prefill(ids)
    checked = backend.score(drafts).clone()  # a graph's output: its next replay overwrites it
    backend.crop(len(ids))
    stepped = torch.cat([backend.decode(torch.tensor([token], device="cuda")).clone() for token in drafts])
    assert checked.shape == stepped.shape == (len(drafts), checked.shape[-1])
    torch.testing.assert_close(checked, stepped, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "case",
    [
        "qwen3-moe-k2",
        "qwen3-moe-k8-head-dim-24",
        "mixtral-k2-tied",
        "phi4-mini-partial-rotary",
        "gemma3-window-8-shorter-than-the-prompt",
        "mistral-window-16",
        "gpt-oss-k2-window-8",
        "gemma2-window-8-softcapped",
    ],
)
@torch.inference_mode()
def test_each_family_replays_in_cuda_graphs_as_transformers_computes(case: str) -> None:
    """The families beyond Llama's in fp32 on CUDA: the graphed decode (the MoE's experts
    gathered by a device-side index, a sliding layer's ring slot and mask from the device-side
    position, gpt-oss's sinks) within 1e-4 of transformers' own forward, past the rings' wrap."""
    from llmcli.engine.native.backend import NativeBackend
    from test_native import CASES, CONTEXT, build, prompt

    model = build(*CASES[case]).to("cuda")
    graphed = NativeBackend(model, CONTEXT, graphs=True)
    ids = prompt(120)  # rings of 72 and 80 slots wrap before the decode steps
    reference = model(torch.tensor([ids], device="cuda")).logits[0].float()
    torch.testing.assert_close(graphed.prefill(ids[:100])[0], reference[99], rtol=0, atol=1e-4)
    for i in range(100, 120):
        step = graphed.decode(torch.tensor([ids[i]], device="cuda"))
        torch.testing.assert_close(step[0], reference[i], rtol=0, atol=1e-4)
    assert graphed.graphs.captures >= 1
