"""A GGUF file's blocks on a GPU (models/gguf_cuda.py): what only a GPU can show — the kernels
compiled for it, replayed in CUDA graphs, and a K-quant file loaded onto it giving the CPU's
logits and tokens. Skipped without CUDA (CI never has one); run with `pytest -m gpu`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gguf_fixtures_dir import fixture
from llama_cpp_reference import kl_and_top1
from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.models.gguf_cuda import GEMV_MAX_ROWS, TYPES, matmul
from llmcli.models.gguf_finite import BLOCK_SCALES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _random_blocks(type_name: str, rows: int, k: int, values: int) -> torch.Tensor:
    """Random blocks on the GPU, every fp16 scale made finite (its exponent's top bit cleared)."""
    nbytes, scales = BLOCK_SCALES[type_name]
    blocks = torch.randint(0, 256, (rows * k // values, nbytes), dtype=torch.uint8, device="cuda")
    for offset, _ in scales:
        blocks[:, offset + 1] &= 0xBF
    return blocks.view(rows, -1)


@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, 40])  # decode, the most GEMV rows, a prefill
@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_the_products_replay_in_a_cuda_graph(type_name: str, rows: int) -> None:
    """Compiled for the GPU, launched inside a graph (nothing created on the device at a call),
    the replay equal to the eager call."""
    values = 32 if type_name in ("Q8_0", "Q4_0") else 256
    k = 1024
    blocks = _random_blocks(type_name, 516, k, values)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    eager = matmul(x, blocks, type_name, k)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    matmul(static_x, blocks, type_name, k)  # warm-up (Triton compiles) outside the capture
    with torch.cuda.graph(graph):
        out = matmul(static_x, blocks, type_name, k)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def _load(kind: str, device: str, **settings: object):
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    loaded = load_model(resolve_model(str(fixture(kind))), LoadSettings(device=device, **settings), lean=True)
    return dataclasses.replace(loaded, eos_token_ids=frozenset())  # every token asked for is generated


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    from llmcli.engine.loop import Engine

    with torch.inference_mode():
        return Engine.for_loaded(loaded).backend.score(ids).float().cpu()


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M", "IQ4_XS", "Q6_K"])
def test_a_k_quant_file_on_a_gpu_runs_its_blocks_as_the_cpu_reads_them(kind: str) -> None:
    """Loaded onto the GPU under --quant auto, every layer stays in the file's blocks there
    (`gguf-blocks`, nothing requantized to int4); in fp32 its logits are the CPU's exact reading
    of the same file (gguf's dequantization, no quantization), its greedy tokens the same through
    the CUDA graphs; in bf16 (the default) within bf16's noise of them, its size what `models
    show` estimates."""
    from llmcli.engine.loop import Engine
    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.load_plan import settled_load
    from llmcli.models.resolve import resolve_model

    path = fixture(kind)
    ids = [int(i) for i in np.load(path.with_name(f"fixture-{kind}.reference.npz"))["ids"][:48]]
    cpu = _load(kind, "cpu", dtype="fp32", quant="none")
    reference = _logits(cpu, ids)
    gpu = _load(kind, "cuda", dtype="fp32")
    assert gpu.quant == "gguf-blocks", gpu.quant
    layers = [m for m in gpu.model.modules() if isinstance(m, BlockLinear)]
    assert layers and all(layer.blocks.is_cuda for layer in layers)
    scale = reference.abs().max().item()
    torch.testing.assert_close(_logits(gpu, ids) / scale, reference / scale, rtol=0, atol=1e-4)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    expected = Engine.for_loaded(cpu).complete(ids[:12], params).token_ids
    graphed = Engine.for_loaded(gpu)
    assert graphed.backend.captures_graphs
    for _ in range(2):  # the second run replays the graphs the first captured
        graphed.reset()
        assert graphed.complete(ids[:12], params).token_ids == expected
    halves = _load(kind, "cuda")
    assert halves.quant == "gguf-blocks" and halves.dtype == torch.bfloat16
    device, dtype, label, estimate = settled_load(resolve_model(str(path)))  # what `models show` says
    assert (device, dtype, label) == ("cuda", "bf16", "gguf-blocks")
    assert abs(estimate / halves.weight_bytes - 1) < 0.03, (estimate, halves.weight_bytes)
    kl, top1 = kl_and_top1(reference.numpy(), _logits(halves, ids))
    assert kl < 5e-3 and top1 >= 0.85, (kl, top1)  # the CPU bf16 path's bounds (test_gguf_fixtures.py)
