"""llmcli's Triton kernels against their torch references, over shapes that cross the kernels'
blocks: on the GPU where there is one, else on CPU tensors under Triton's interpreter (CI)."""

from __future__ import annotations

import pytest
import torch

from llmcli.engine.native.gathered_cuda import gathered_matvec
from llmcli.errors import UsageError
from llmcli.models.int4_cuda import KERNEL_ENV, chosen_kernel, int4_matmul
from llmcli.models.int4_cuda import MAX_ROWS as INT4_MAX_ROWS
from llmcli.models.int4_cuda import pack as pack_int4
from llmcli.models.int4_cuda import unpack as unpack_int4
from llmcli.models.int8_cuda import GEMV_MAX_ROWS, int8_matmul
from triton_kernels import kernel_device

from cli_helpers import one_error_line, run_cli


@pytest.fixture(scope="module")
def device() -> torch.device:
    return kernel_device()


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 37, 100),  # widths that are no multiple of BLOCK_N (4) nor BLOCK_K
        (2, 33, 129),  # the few-rows kernel's smallest: channels and columns one past its block
        (3, 4, 16),  # the smallest block, exactly
        (GEMV_MAX_ROWS, 9, 513),  # the most rows read as codes (a check pass of 16); K one past a block
        (GEMV_MAX_ROWS + 1, 9, 130),  # one more: the dequantizing path
        (1, 11, 8200),  # K ≥ 8192: the long-row configuration (8 × 1024), ragged
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_matches_the_dequantized_product(
    device: torch.device, rows: int, n: int, k: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    codes = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8).to(device)
    scales = (torch.rand(n, generator=generator) / 64).to(device, dtype)
    out = int8_matmul(x, codes, scales)
    assert out.shape == (rows, n) and out.dtype == dtype
    reference = x.double() @ (codes.double() * scales.double()[:, None]).T
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    scale = reference.abs().max().item()
    torch.testing.assert_close(out.double() / scale, reference / scale, rtol=0, atol=tolerance)


def test_int8_gemv_takes_strided_codes_on_a_correct_path(device: torch.device) -> None:
    """The kernel indexes codes as contiguous [N, K] rows: a transposed view must not be read so."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 24, generator=generator).to(device)
    stored = torch.randint(-127, 128, (24, 20), generator=generator, dtype=torch.int8).to(device)
    codes = stored.T  # [20, 24], K not the contiguous dimension
    scales = torch.rand(40, generator=generator).to(device)[::2]  # every other: strided too
    reference = x.double() @ (codes.double() * scales.double()[:, None]).T
    torch.testing.assert_close(int8_matmul(x, codes, scales).double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["experts-out-in", "experts-in-out"])  # Qwen3-MoE, gpt-oss
@pytest.mark.parametrize(("shared_input", "slots"), [(True, 4), (False, 3), (True, 1)])
def test_gathered_experts_read_the_chosen_ones(
    device: torch.device, dtype: torch.dtype, layout: str, shared_input: bool, slots: int
) -> None:
    generator = torch.Generator().manual_seed(slots)
    experts, n, k = 6, 130, 520  # ragged against both layouts' blocks (4 × 512, 128 × 32)
    stored = torch.randn(experts, n, k, generator=generator).to(device, dtype)
    # gpt-oss stores [experts, in, out]: the same values, N the contiguous dimension
    stacked = stored if layout == "experts-out-in" else stored.transpose(1, 2).contiguous().transpose(1, 2)
    x = torch.randn(k if shared_input else (slots, k), generator=generator).to(device, dtype)
    chosen = torch.tensor([5, 0, 5, 2][:slots], device=device)  # an expert twice, the first, the last
    out = gathered_matvec(stacked, chosen, x)
    assert out.shape == (slots, n) and out.dtype == dtype
    inputs = x.double().expand(slots, -1).unsqueeze(-1)
    reference = torch.matmul(stacked.double().index_select(0, chosen), inputs).squeeze(-1)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    scale = reference.abs().max().item()
    torch.testing.assert_close(out.double() / scale, reference / scale, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
    ("rows", "n", "k", "group"),
    [
        (1, 37, 96, 32),  # one row: N no multiple of its BLOCK_N (16), K short of its BLOCK_K (256)
        (1, 5, 544, 32),  # one row, K past two blocks, the second ending inside a group
        (1, 19, 384, 128),  # one row, a block of a whole group (128 columns)
        (2, 33, 160, 32),  # the fewest rows of a check: channels one past BLOCK_N (32), K past BLOCK_K
        (3, 20, 512, 256),  # a group of two blocks
        (INT4_MAX_ROWS, 9, 256, 64),  # the most rows read as codes: a check pass of 16
        (INT4_MAX_ROWS + 1, 9, 128, 32),  # one more: the dequantizing path
        (4, 9, 96, 16),  # a group the kernel does not tile (< 32): the dequantizing path
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_the_codes_product(
    device: torch.device, rows: int, n: int, k: int, group: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=generator) / 16).to(dtype)
    zeros = (torch.randn(n, k // group, generator=generator) / 64).to(dtype)
    # QuantizedLinear's layout for both kernels: [K / group, N, 2]
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(device)
    packed = pack_int4(codes.to(device))
    assert packed.shape == (n, k // 2) and torch.equal(unpack_int4(packed).cpu(), codes)
    out = int4_matmul(x, packed, scales_and_zeros, group)
    assert out.shape == (rows, n) and out.dtype == dtype
    grouped = (codes.double().view(n, -1, group) - 8) * scales.double()[..., None] + zeros.double()[..., None]
    reference = x.double() @ grouped.view(n, k).to(device).T
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    scale = reference.abs().max().item()
    torch.testing.assert_close(out.double() / scale, reference / scale, rtol=0, atol=tolerance)


def test_an_int4_kernel_that_is_none_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, "fastest")
    with pytest.raises(UsageError, match="LLMCLI_INT4_CUDA=fastest is not an int4 kernel: choose triton or"):
        chosen_kernel()
    monkeypatch.setenv(KERNEL_ENV, " TinyGemm ")
    assert chosen_kernel() == "tinygemm"


def test_a_bad_int4_kernel_name_is_refused_by_a_load_on_any_device(tiny_llama) -> None:
    """Read wherever int4 codes are packed, not on CUDA alone: a CPU run that names none is told."""
    proc = run_cli(
        "generate", "-m", str(tiny_llama), "--quant", "int4", "--device", "cpu", "-n", "2", "hi",
        env={KERNEL_ENV: "fastest"},
    )  # fmt: skip
    assert "LLMCLI_INT4_CUDA=fastest is not an int4 kernel" in one_error_line(proc, 2)


@pytest.mark.parametrize("rows", [1, 5])
def test_the_int4_kernel_reads_a_quantized_layer_as_torch_s_kernel_does(
    device: torch.device, rows: int
) -> None:
    """The layer's own scales-and-zeros buffer (tinygemm's layout, built by from_codes) through
    the Triton kernel, against torch's int4 kernel on the same layer: the two layouts agree."""
    from llmcli.models.quantized import QuantizedLinear, _int4_mm_triton

    generator = torch.Generator().manual_seed(rows)
    n, k, group = 48, 256, 64
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=generator) / 16
    zeros = torch.randn(n, k // group, generator=generator) / 64
    torch_layer = QuantizedLinear.from_codes(codes, scales, zeros, None, group, torch.bfloat16)
    ours = QuantizedLinear(
        "int4", pack_int4(codes).to(device), torch_layer.scales.to(device), None, (n, k), group
    )
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    expected = torch_layer(x).double()
    got = _int4_mm_triton(x.to(device), ours).double().cpu()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=2e-2)
