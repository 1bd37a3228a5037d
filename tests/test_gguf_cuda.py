"""The GGUF block kernels for the GPU (models/gguf_cuda.py) against gguf's own reading of the
blocks: every type's values bit for bit in fp32, every product against a float64 reference over
shapes that cross the kernels' tiles; on the GPU where there is one, else on CPU tensors under
Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_fixtures_dir import fixture
from llmcli.models.gguf_cuda import GEMV_MAX_ROWS, TYPES, dequantize, matmul
from llmcli.models.gguf_finite import BLOCK_SCALES
from test_gguf_fixtures import load, logits_on
from triton_kernels import kernel_device

gguf = pytest.importorskip("gguf")

QUANTIZABLE = {"Q8_0", "Q4_0"}  # the ones gguf's Python package can quantize (not the K-quants, nor IQ4_XS)


@pytest.fixture(scope="module")
def device() -> torch.device:
    return kernel_device()


def _block_size(type_name: str) -> tuple[int, int]:
    """(values, bytes) a block of the type."""
    return gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def _blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of the type: gguf's quantization of random weights where it
    has one, else random bytes (every bit pattern of the codes and sub-block scales) with each
    fp16 scale made finite (below 2 in magnitude, subnormals and signs kept)."""
    rng = np.random.default_rng(seed)
    if type_name in QUANTIZABLE:
        weights = rng.standard_normal((rows, k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])).view(
            np.uint8
        )
    values, nbytes = _block_size(type_name)
    blocks = rng.integers(0, 256, (rows * k // values, nbytes), dtype=np.uint8)
    block_bytes, scales = BLOCK_SCALES[type_name]
    assert block_bytes == nbytes
    for offset, _ in scales:
        blocks[:, offset + 1] &= 0xBF  # the exponent's top bit cleared: never all ones
    return blocks.reshape(rows, -1)


def _reference(blocks: np.ndarray, type_name: str, k: int) -> np.ndarray:
    values = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[type_name])
    return values.reshape(blocks.shape[0], k)


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_blocks_read_back_bit_equal_to_gguf(device: torch.device, type_name: str) -> None:
    """Three super-blocks' width (a tile boundary crossed; 24 blocks of Q8_0/Q4_0) over rows that
    end inside a program's channels."""
    values, _ = _block_size(type_name)
    k = 768 if values == 256 else 32 * 13  # Q8_0, Q4_0: a row ending inside the second tile
    blocks = _blocks(type_name, 6, k, seed=len(type_name))
    expected = _reference(blocks, type_name, k)
    got = dequantize(torch.from_numpy(blocks).to(device), type_name, k, torch.float32)
    assert got.shape == (6, k) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.cpu().numpy(), expected)
    halves = dequantize(torch.from_numpy(blocks).to(device), type_name, k, torch.bfloat16)
    assert torch.equal(halves.cpu(), torch.from_numpy(expected).bfloat16())


@pytest.mark.parametrize(
    ("rows", "n", "blocks"),
    [
        (1, 37, 1),  # one row; out_features no multiple of BLOCK_N (4; 32 interpreted); one block
        (3, 4, 2),  # exactly one program's channels; two super-blocks (a 256-value boundary)
        (GEMV_MAX_ROWS, 9, 3),  # the most rows the GEMV takes
        (GEMV_MAX_ROWS + 1, 9, 2),  # one more: dequantized, one torch matmul
        (2, 5, 11),  # Q8_0/Q4_0: 352 values, the second tile cut short (K-quants: one super-block)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_products_match_a_float64_reference(
    device: torch.device, type_name: str, rows: int, n: int, blocks: int, dtype: torch.dtype
) -> None:
    values, _ = _block_size(type_name)
    k = values * (
        blocks if values == 32 or blocks <= 3 else 1
    )  # 11 super-blocks: interpreter time, no new boundary
    weights = _blocks(type_name, n, k, seed=rows * n + blocks)
    generator = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    out = matmul(x.to(device), torch.from_numpy(weights).to(device), type_name, k)
    assert out.shape == (rows, n) and out.dtype == dtype
    reference = x.double() @ torch.from_numpy(_reference(weights, type_name, k)).double().T
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the result (and prefill's weights) rounded
    scale = reference.abs().max().item()
    torch.testing.assert_close(out.cpu().double() / scale, reference / scale, rtol=0, atol=tolerance)


def test_views_are_read_as_the_values_they_show(device: torch.device) -> None:
    """Every other row of the blocks, and a transposed input: copied to whole rows, never read
    with the wrong stride."""
    k = 512
    weights = _blocks("Q4_K", 10, k, seed=3)
    every_other = torch.from_numpy(weights).to(device)[::2]
    x = torch.randn(k, 2).to(device).T  # [2, k], not contiguous
    out = matmul(x, every_other, "Q4_K", k)
    reference = x.cpu().double() @ torch.from_numpy(_reference(weights[::2], "Q4_K", k)).double().T
    torch.testing.assert_close(
        out.cpu().double(), reference, rtol=0, atol=1e-5 * reference.abs().max().item()
    )


@pytest.mark.parametrize(
    ("type_name", "in_features", "row_bytes", "message"),
    [
        ("Q2_K", 256, 84, "no GPU kernel reads GGUF type Q2_K"),
        ("Q8_0", 100, 34 * 3, "not a multiple"),
        ("Q4_K", 512, 144, "take 288 bytes, not 144"),
    ],
)
def test_shapes_the_kernels_do_not_cover_are_refused(
    device: torch.device, type_name: str, in_features: int, row_bytes: int, message: str
) -> None:
    blocks = torch.zeros(3, row_bytes, dtype=torch.uint8, device=device)
    x = torch.zeros(1, in_features, device=device)
    for call in (lambda: dequantize(blocks, type_name, in_features, torch.float32),
                 lambda: matmul(x, blocks, type_name, in_features)):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()


def test_an_input_of_the_wrong_width_is_refused(device: torch.device) -> None:
    blocks = torch.zeros(3, 34, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"not \[rows, 32\]"):
        matmul(torch.zeros(1, 64, device=device), blocks, "Q8_0", 32)


def test_a_gguf_file_on_a_gpu_keeps_its_blocks_for_these_kernels() -> None:
    """Under --quant auto a GGUF file read in place onto a GPU keeps every layer of a type these
    kernels decode in its blocks (the load's choice, made without a GPU); --quant int4 named
    still asks for llmcli's requantized layers."""
    import dataclasses

    from llmcli.config.settings import LoadSettings
    from llmcli.models.gguf_cuda import KERNELS
    from llmcli.models.load import _block_kernels
    from llmcli.models.load_plan import block_types, plan_load
    from llmcli.models.resolve import resolve_model

    checkpoint = resolve_model(str(fixture("Q4_K_M")))
    assert block_types(checkpoint, "auto", "cuda") == TYPES
    assert block_types(checkpoint, "int4", "cuda") == frozenset()
    settings = LoadSettings(device="cpu")
    on_gpu = dataclasses.replace(plan_load(checkpoint, settings), device=torch.device("cuda"))
    assert _block_kernels(checkpoint, settings, on_gpu) is KERNELS


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M", "IQ4_XS"])
def test_a_mixed_file_runs_on_these_kernels_each_layer_in_its_type(device: torch.device, kind: str) -> None:
    """llama.cpp's files quantized as load.py quantizes them for a GPU (these kernels on the
    blocks): every layer of the file's types in its own blocks (Q4_K beside Q6_K, Q5_K beside
    Q6_K, IQ4_XS beside a Q6_K head), run on the kernels — on CPU tensors under the interpreter
    here — and the logits those of the same file dequantized by gguf, in fp32."""
    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.gguf_cuda import KERNELS
    from llmcli.models.quantized import quantize_model
    from llmcli.models.resolve import resolve_model

    path = fixture(kind)
    if device.type == "cuda":
        pytest.skip("built on the CPU here; the GPU's own load is test_gpu.py's")
    ids = np.load(path.with_name(f"fixture-{kind}.reference.npz"))["ids"][:6]  # six rows: the GEMV
    reference = logits_on(load(path, dtype="fp32", quant="none"), ids)
    loaded = load(path, dtype="fp32", quant="none")
    quant = quantize_model(loaded.model, "int4", 32, resolve_model(str(path)).exact_codes(), KERNELS)
    assert quant == "gguf-blocks"
    layers = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    assert {layer.type_name for layer in layers} == {kind.removesuffix("_M"), "Q6_K"}
    assert all(layer.kernels is KERNELS for layer in layers)
    logits = logits_on(loaded, ids)
    scale = reference.abs().max().item()
    torch.testing.assert_close(logits / scale, reference / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS + 1, 33])  # the GEMV, dequantized, BlockLinear's prefill
def test_a_block_layer_on_these_kernels_multiplies_any_rows(device: torch.device, rows: int) -> None:
    """A layer of llama.cpp's own Q6_K blocks (a projection of the Q4_K_M file) held as
    BlockLinear holds it on a GPU: decode, a check pass and a prefill (which BlockLinear sends
    to `dequantized` and one matmul) all give x times gguf's reading of the blocks."""
    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.gguf_cuda import KERNELS
    from llmcli.models.resolve import resolve_model

    exact = resolve_model(str(fixture("Q4_K_M"))).exact_codes()
    names = [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.v_proj")]
    name = next(name for name in names if exact.block_type(name) == "Q6_K")
    blocks, type_name = exact.blocks(name), "Q6_K"
    k = blocks.shape[1] // 210 * 256
    weights = torch.from_numpy(_reference(blocks.numpy(), type_name, k))
    layer = BlockLinear(KERNELS, blocks.to(device), type_name, k, None, torch.float32)
    x = torch.randn(1, rows, k, generator=torch.Generator().manual_seed(rows))
    out = layer(x.to(device))
    assert out.shape == (1, rows, blocks.shape[0])
    reference = x.double() @ weights.double().T
    scale = reference.abs().max().item()
    torch.testing.assert_close(out.cpu().double() / scale, reference / scale, rtol=0, atol=1e-5)


def test_every_kernel_compiles_for_an_h100_without_spilling(tmp_path: Path) -> None:
    """The interpreter runs the kernels' Python, not Triton's compiler: what only the compiler
    refuses (a global that is no tl.constexpr object, a construct it cannot lower) or spills
    would reach a GPU unseen. Compiled here for sm_90 by Triton's own ptxas, no GPU needed."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gguf_cuda_sass.py"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}  # compiled afresh, in no user's cache
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, env=env)
    if done.returncode == 2:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("every kernel compiles for sm_90 unspilled")


def test_the_fit_check_sizes_a_gguf_files_blocks_as_a_gpu_holds_them() -> None:
    """The memory check before a load on a GPU asks the estimate `models show` gives (one
    estimate): a file read in place keeps these kernels' types in their blocks there, so its
    layers count at the blocks' real bytes, not as int4 codes. Asked for cuda without loading;
    the blocks are those quantize_model keeps for a GPU, built on the CPU."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.gguf_cuda import KERNELS
    from llmcli.models.load_plan import plan_load, planned_weight_bytes
    from llmcli.models.memory import estimate_weight_bytes, is_native_linear, native_mode
    from llmcli.models.quantized import quantize_model
    from llmcli.models.resolve import resolve_model

    path = fixture("Q4_K_M")
    checkpoint = resolve_model(str(path))
    plan = plan_load(checkpoint, LoadSettings(device="cpu"))
    shapes = checkpoint.shapes
    mode = native_mode(plan.native_quant, plan.group, shapes)
    estimate = planned_weight_bytes(checkpoint, LoadSettings(), mode, 2, "cuda")
    loaded = load(path, dtype="bf16", quant="none")
    quant = quantize_model(loaded.model, "int4", plan.group, checkpoint.exact_codes(), KERNELS)
    assert quant == "gguf-blocks"
    blocks = sum(m.blocks.nbytes for m in loaded.model.modules() if isinstance(m, BlockLinear))
    rest = sum(t.count * 2 for name, t in shapes.items() if not is_native_linear(name, t.shape))
    assert estimate == blocks + rest
    as_int4 = estimate_weight_bytes(shapes, 2, mode, device_type="cuda")  # the codes: not what loads
    assert estimate != as_int4
