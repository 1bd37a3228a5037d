"""A Llama-style block around its attention in llmcli's compiled kernels (engine/native/
compiled_layer.py, src/csrc/layer.c) against the same block on torch's small calls, over the
same products on the file's blocks: Llama, Qwen2's q/k/v biases and Qwen3's q and k norms, a
prompt at once and token by token, in fp32 and bf16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_files import rewrite_gguf
from gguf_fixtures_dir import fixture
from llmcli.models import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernels() is None or not cpu_kernels.kernels().types >= {"Q8_0"},
    reason="llmcli was built without its compiled kernels",
)


def _file(architecture: str, tmp_path: Path) -> Path:
    """The Q8_0 fixture as `architecture`, with what that family adds drawn at random."""
    rng = np.random.default_rng(1)
    add: dict[str, np.ndarray] = {}
    if architecture == "qwen3":  # per-head norms of q and k (64 wide)
        add = {f"blk.{i}.attn_{n}_norm.weight": rng.uniform(0.5, 1.5, 64) for i in range(2) for n in "qk"}
    if architecture == "qwen2":  # biases on q (256 wide), k and v (128 each)
        widths = {"q": 256, "k": 128, "v": 128}
        add = {f"blk.{i}.attn_{n}.bias": rng.normal(0, 0.5, w) for i in range(2) for n, w in widths.items()}
    return rewrite_gguf(
        fixture("Q8_0"), tmp_path / f"{architecture}.gguf", architecture=architecture, add=add
    )


def _run(
    path: Path, dtype: str, fused: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits at every position, and 8 greedy tokens after it, one step at a time.
    The prompt is shorter than block_linear.GEMM_ROWS: longer ones take torch's GEMM instead."""
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.loop import Engine
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    monkeypatch.setenv("LLMCLI_CPU_FUSED", fused)
    monkeypatch.setenv(cpu_kernels.ENV, cpu_kernels.kernels().level)  # every file on the kernels
    loaded = load_model(resolve_model(str(path)), LoadSettings(device="cpu", dtype=dtype), lean=True)
    backend = Engine.for_loaded(loaded).backend
    compiled = [block.compiled is not None for block in backend.net.blocks]
    assert compiled == [fused == "1"] * len(compiled)
    ids = [
        int(i) for i in np.load(fixture("Q8_0").with_name("fixture-Q8_0.reference.npz"))["ids"][:40]
    ]  # same text
    with torch.inference_mode():
        logits = backend.score(ids).float()
        backend.reset()
        step = backend.prefill(ids)
        tokens = []
        for _ in range(8):
            tokens.append(int(step.float().argmax()))
            step = backend.decode(torch.tensor([tokens[-1]]))
    return logits, tokens


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_compiled_block_computes_what_torchs_calls_compute(
    architecture: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(architecture, tmp_path)
    ours, our_tokens = _run(path, dtype, "1", monkeypatch)
    theirs, their_tokens = _run(path, dtype, "0", monkeypatch)
    scale = theirs.abs().max().item()
    # fp32: the same products on the same int8 activations; only the order of a few sums differs
    # (in Qwen3's per-head norms enough to move one activation across an int8 rounding step, at
    # one position, which every later position's attention then reads: measured 1 % there).
    # bf16: torch's path rounds to bf16 between its calls, the compiled block keeps fp32.
    tolerance = 0.05 if dtype == "bf16" else 0.02 if architecture == "qwen3" else 1e-4
    assert (ours - theirs).abs().max().item() <= tolerance * scale
    if dtype == "fp32":
        assert our_tokens == their_tokens


def test_a_16_bit_file_is_multiplied_on_its_own_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An F16 file on a CPU that holds it in fp16: every linear layer is the kernels' F16 rows
    over the weights' own bytes (nothing held twice), its blocks compiled, the logits those of
    torch's small calls over the same products within fp16's rounding."""
    from llmcli.models.block_linear import BlockLinear

    path = fixture("F16")
    if "F16" not in cpu_kernels.kernels().types:
        pytest.skip("no F16 kernel in this build")
    ours, _ = _run(path, "auto", "1", monkeypatch)
    theirs, _ = _run(path, "auto", "0", monkeypatch)
    assert (ours - theirs).abs().max().item() <= 0.01 * theirs.abs().max().item()
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    loaded = load_model(resolve_model(str(path)), LoadSettings(device="cpu"), lean=True)
    if loaded.dtype_name != "fp16":
        pytest.skip("this CPU holds F16 files in fp32")
    linears = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    assert linears and all(m.type_name == "F16" for m in linears) and loaded.quant == "gguf-blocks"
    assert loaded.weight_bytes <= 1.05 * path.stat().st_size


def test_a_wrong_switch_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmcli.engine.native.compiled_layer import fused_layers_wanted
    from llmcli.errors import UsageError

    monkeypatch.setenv("LLMCLI_CPU_FUSED", "yes")
    with pytest.raises(UsageError, match="LLMCLI_CPU_FUSED=yes"):
        fused_layers_wanted()
