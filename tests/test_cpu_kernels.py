"""llmcli's compiled CPU kernels (src/csrc/, models/cpu_kernels.py) against gguf's own reading of
llama.cpp's files: every type's blocks read back bit for bit, every product equal to a scalar
reference in float64 on the same quantized activations, on every level this CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmcli.models import cpu_kernels

gguf = pytest.importorskip("gguf")
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "gguf-fixtures"
LEVELS = [level for level in cpu_kernels.built_levels() if cpu_kernels.runs_here(level)]
pytestmark = pytest.mark.skipif(not LEVELS, reason="llmcli was built without its compiled kernels")


def _level(level: str) -> cpu_kernels.CpuKernels:
    loaded = cpu_kernels._load(level)
    assert loaded is not None and loaded.level == level
    return loaded


def _tensors_by_type() -> dict[str, tuple[np.ndarray, tuple[int, int]]]:
    """One 2-D tensor of each type the fixtures hold: its raw blocks and (rows, k)."""
    found: dict[str, tuple[np.ndarray, tuple[int, int]]] = {}
    for path in sorted(FIXTURES.glob("fixture-*.gguf")):
        for tensor in gguf.GGUFReader(path).tensors:
            name = tensor.tensor_type.name
            if name in cpu_kernels.TYPE_IDS and name not in found and len(tensor.shape) == 2:
                k, rows = (int(v) for v in tensor.shape)
                found[name] = (np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1), (rows, k))
    return found


TENSORS = _tensors_by_type() if FIXTURES.is_dir() else {}


def _reference_activations(x: np.ndarray, act: str) -> np.ndarray:
    """x as llama.cpp's reference quantizer leaves it (ggml-quants.c), back in float64."""
    if act in ("F16", "BF16"):
        dtype = torch.float16 if act == "F16" else torch.bfloat16
        return torch.from_numpy(x).to(dtype).double().numpy()
    size = 256 if act == "Q8_K" else 32
    blocks = x.reshape(x.shape[0], -1, size).astype(np.float32)
    if act == "Q8_K":  # scale by the signed value of largest magnitude, rounding half to even
        index = np.abs(blocks).argmax(-1)
        peak = np.take_along_axis(blocks, index[..., None], -1)
        iscale = np.where(peak == 0, 0, np.float32(-127.0) / np.where(peak == 0, 1, peak)).astype(np.float32)
        q = np.minimum(np.rint(blocks * iscale), 127)
        d = np.where(iscale == 0, 0, 1 / np.where(iscale == 0, 1, iscale)).astype(np.float32)
    else:  # amax / 127 in fp16, rounding half away from zero
        d32 = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
        inverse = np.where(d32 == 0, 0, 1 / np.where(d32 == 0, 1, d32)).astype(np.float32)
        scaled = blocks * inverse
        q = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
        d = d32.astype(np.float16).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def _gguf_values(blocks: np.ndarray, type_name: str, rows: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[type_name]).reshape(rows, k)


ACTIVATIONS = {"F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "IQ4_NL": "Q8_0",
               "Q4_1": "Q8_1", "Q5_1": "Q8_1"}  # fmt: skip


# The types every level must multiply: a build that lost one would otherwise only skip its tests.
WRITTEN = {"F16", "BF16", "Q4_0", "Q8_0", "Q2_K", "Q3_K", "IQ4_XS"}


@pytest.mark.parametrize("level", LEVELS)
def test_every_written_type_has_its_kernel(level: str) -> None:
    assert _level(level).types >= WRITTEN


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("type_name", sorted(TENSORS))
def test_blocks_read_back_as_gguf_reads_them(level: str, type_name: str) -> None:
    kernels = _level(level)
    if type_name not in kernels.types:
        pytest.skip(f"no {type_name} kernel yet")
    blocks, (rows, k) = TENSORS[type_name]
    expected = _gguf_values(blocks, type_name, rows, k)
    got = kernels.dequantize(torch.from_numpy(blocks), type_name, rows, k).numpy()
    np.testing.assert_array_equal(got, expected.astype(np.float32))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("type_name", sorted(TENSORS))
@pytest.mark.parametrize("m", [1, 3, 17])
def test_products_equal_a_scalar_reference(level: str, type_name: str, m: int) -> None:
    kernels = _level(level)
    if type_name not in kernels.types:
        pytest.skip(f"no {type_name} kernel yet")
    blocks, (rows, k) = TENSORS[type_name]
    rows = min(rows, 301)  # an odd count: the threads' shares end inside a run of rows
    blocks = blocks[:rows]
    weights = _gguf_values(blocks, type_name, rows, k)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0  # a block of zeros: its scale is 0
    expected = _reference_activations(x, ACTIVATIONS.get(type_name, "Q8_K")) @ weights.astype(np.float64).T
    got = kernels.matmul(torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(blocks)), type_name, rows)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=scale * 2e-5)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("type_name", ["F16", "BF16"])
@pytest.mark.parametrize("k", [32, 96, 160])
def test_float_rows_end_inside_a_vector(level: str, type_name: str, k: int) -> None:
    """F16 and BF16 take any row of whole 32s: the vector loops (64 or 128 elements a step) end
    on a remainder the tail must finish, which the fixtures' widths never leave."""
    kernels = _level(level)
    rng = np.random.default_rng(k)
    rows, m = 37, 3
    blocks = np.ascontiguousarray(
        gguf.quants.quantize(
            rng.standard_normal((rows, k)).astype(np.float32), gguf.GGMLQuantizationType[type_name]
        )
    ).view(np.uint8)
    weights = _gguf_values(blocks, type_name, rows, k)
    read = kernels.dequantize(torch.from_numpy(blocks), type_name, rows, k).numpy()
    np.testing.assert_array_equal(read, weights.astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    expected = _reference_activations(x, type_name) @ weights.astype(np.float64).T
    got = kernels.matmul(torch.from_numpy(x), torch.from_numpy(blocks), type_name, rows)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=np.abs(expected).max() * 2e-5)


def test_each_build_was_compiled_for_no_more_than_its_level_needs() -> None:
    """The loader's table of what each level needs is what the compiler was told: a level
    whose flags grew without the table would be loaded on a CPU that lacks them."""
    for level in LEVELS:
        built = cpu_kernels._open(cpu_kernels._library_path(level)).llmcli_build_features()
        assert built & ~cpu_kernels._NEEDS[level] == 0, level
        assert cpu_kernels._NEEDS[level] & ~built == 0, level


def _which(env: str) -> subprocess.CompletedProcess[str]:
    code = "from llmcli.models import cpu_kernels; print(cpu_kernels.which())"
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, cpu_kernels.ENV: env}, capture_output=True, text=True
    )


def test_a_level_is_chosen_by_name_or_turned_off() -> None:
    assert _which("off").stdout.strip() == f"torch ({cpu_kernels.ENV}=off)"
    for level in LEVELS:
        assert _which(level).stdout.strip() == f"llmcli {level}"
    wrong = _which("sse9")
    assert wrong.returncode != 0 and "not a kernel level" in wrong.stderr
