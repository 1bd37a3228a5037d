"""llmcli's compiled CPU kernels (src/csrc/, models/cpu_kernels.py) against gguf's own reading of
llama.cpp's files: every type's blocks read back bit for bit, every product equal to a scalar
reference in float64 on the same quantized activations, on every level this CPU runs."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmcli.models import cpu_kernels

from cli_helpers import one_error_line, run_cli

gguf = pytest.importorskip("gguf")
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "gguf-fixtures"
PACKAGE = Path(cpu_kernels.__file__).resolve().parents[1]
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


def _reference_product(x: np.ndarray, blocks: np.ndarray, type_name: str, rows: int, k: int) -> np.ndarray:
    """x · Wᵀ in float64 on x's quantized activations, as llama.cpp computes it: for the types
    with a minimum (Q4_1, Q5_1: d·q + m), the minimum multiplies the Q8_1 block's `s`, its
    d · Σq rounded to fp16, rather than the activations themselves."""
    act = ACTIVATIONS.get(type_name, "Q8_K")
    weights = _gguf_values(blocks, type_name, rows, k).astype(np.float64)
    activations = _reference_activations(x, act)
    if act != "Q8_1":
        return activations @ weights.T
    block_bytes = blocks.shape[1] * 32 // k
    minimums = blocks.reshape(rows, -1, block_bytes)[:, :, 2:4].copy().view(np.float16)[..., 0]
    minimums = minimums.astype(np.float64)
    d32 = (np.abs(x.reshape(x.shape[0], -1, 32)).max(-1) / np.float32(127)).astype(np.float32)
    d16 = np.where(d32 == 0, 1, d32.astype(np.float16))
    quantized = activations.reshape(x.shape[0], -1, 32) / d16[..., None]
    sums = (np.rint(quantized).sum(-1).astype(np.float32) * d32).astype(np.float16).astype(np.float64)
    return activations @ (weights - np.repeat(minimums, 32, axis=1)).T + sums @ minimums.T


@pytest.mark.parametrize("level", LEVELS)
def test_every_type_has_its_kernel_on_every_level(level: str) -> None:
    """Every type llmcli names is multiplied on every level (a build that lost one would fall back
    to torch on every such file while the tests of that type skipped), and the fixtures hold a
    tensor of each, so none of the tests above is left out."""
    assert _level(level).types == set(cpu_kernels.TYPE_IDS)
    if FIXTURES.is_dir():
        assert set(TENSORS) == set(cpu_kernels.TYPE_IDS)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("type_name", sorted(TENSORS))
def test_blocks_read_back_as_gguf_reads_them(level: str, type_name: str) -> None:
    kernels = _level(level)
    blocks, (rows, k) = TENSORS[type_name]
    expected = _gguf_values(blocks, type_name, rows, k)
    got = kernels.dequantize(torch.from_numpy(blocks), type_name, rows, k).numpy()
    np.testing.assert_array_equal(got, expected.astype(np.float32))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("type_name", sorted(TENSORS))
@pytest.mark.parametrize("m", [1, 3, 17])
def test_products_equal_a_scalar_reference(level: str, type_name: str, m: int) -> None:
    kernels = _level(level)
    blocks, (rows, k) = TENSORS[type_name]
    rows = min(rows, 301)  # an odd count: the threads' shares end inside a run of rows
    _assert_product_equals_reference(kernels, blocks[:rows], type_name, rows, k, m)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
def test_products_on_rows_of_an_odd_number_of_blocks(level: str, type_name: str) -> None:
    """The vector kernels take blocks two or more at a time: a row of 11 blocks ends on a lone
    one. The fixture's blocks, each independent of its row, are cut into rows of 11."""
    blocks, (rows, k) = TENSORS[type_name]
    block_bytes = blocks.shape[1] * 32 // k
    rows = 200
    k = 11 * 32
    cut = blocks.reshape(-1)[: rows * 11 * block_bytes].reshape(rows, -1)
    _assert_product_equals_reference(_level(level), cut, type_name, rows, k, m=3)


def _assert_product_equals_reference(
    kernels: cpu_kernels.CpuKernels, blocks: np.ndarray, type_name: str, rows: int, k: int, m: int
) -> None:
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0  # a block of zeros: its scale is 0
    expected = _reference_product(x, blocks, type_name, rows, k)
    got = kernels.matmul(torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(blocks)), type_name, rows)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=scale * 2e-5)


@pytest.mark.parametrize("level", LEVELS)
def test_bf16_rows_are_read_and_written_as_they_are(level: str) -> None:
    """A bf16 model's rows go in and come out in bf16: the same products as the fp32 rows they
    stand for, each rounded to bf16 once (a 4,096-wide row is widened in pieces)."""
    kernels = _level(level)
    blocks, (_, k) = TENSORS["Q8_0"]
    wide = np.tile(blocks[:64], (1, 20))  # rows of 5,120 values: widened in two pieces
    x = torch.randn(5, k * 20).bfloat16()
    expected = kernels.matmul(x.float(), torch.from_numpy(wide), "Q8_0", 64).bfloat16()
    got = kernels.matmul(x, torch.from_numpy(wide), "Q8_0", 64)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("act", ["Q8_0", "Q8_1"])
def test_activations_are_quantized_as_the_reference_quantizer_does(level: str, act: str) -> None:
    """Byte for byte, on every level (the vector quantizers round half away from zero as roundf
    does): a row of ordinary values, one of half-integers whose block maximum is 127 (the scale is
    1, so every value is a tie), and a block of zeros."""
    rng = np.random.default_rng(5)
    ties = rng.integers(-254, 255, 256) / 2
    ties[::32] = 127
    x = np.concatenate([rng.standard_normal(256) * 3, ties, np.zeros(32)]).astype(np.float32)
    block_bytes = 34 if act == "Q8_0" else 36
    got = np.zeros(len(x) // 32 * block_bytes, dtype=np.uint8)
    quantize = _level(level).library.llmcli_quantize_activations
    quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    assert quantize(gguf.GGMLQuantizationType[act].value, x.ctypes.data, len(x), got.ctypes.data) == 0
    got = got.reshape(-1, block_bytes)
    blocks = x.reshape(-1, 32)
    d32 = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    scaled = blocks * np.where(d32 == 0, 0, 1 / np.where(d32 == 0, 1, d32)).astype(np.float32)[:, None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    np.testing.assert_array_equal(got[:, :2].copy().view(np.float16)[:, 0], d32.astype(np.float16))
    np.testing.assert_array_equal(got[:, block_bytes - 32 :].view(np.int8), q)
    if act == "Q8_1":
        sums = (q.sum(-1).astype(np.float32) * d32).astype(np.float16)
        np.testing.assert_array_equal(got[:, 2:4].copy().view(np.float16)[:, 0], sums)


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


def test_auto_puts_on_the_kernels_the_files_torch_would_requantize(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `auto` a file with any layer torch's path holds as well (4-bit int4 codes, 16-bit
    weights) keeps torch's path; one of 5-8-bit, IQ4 or Q2/Q3 layers takes the kernels; a level
    named puts every file on them."""
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    assert cpu_kernels.takes_file(frozenset({"Q6_K", "IQ4_XS"}))
    assert not cpu_kernels.takes_file(frozenset({"Q4_K", "Q6_K"}))
    assert not cpu_kernels.takes_file(frozenset({"F16"}))
    monkeypatch.setenv(cpu_kernels.ENV, LEVELS[0])
    assert cpu_kernels.takes_file(frozenset({"Q4_K", "Q6_K"})) and cpu_kernels.takes_file(frozenset({"F16"}))


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


def test_a_bad_choice_at_the_command_line_is_one_line_before_any_model_is_looked_for() -> None:
    line = one_error_line(
        run_cli("generate", "-m", "/nonexistent/model", "hi", env={cpu_kernels.ENV: "sse9"}), 2
    )
    assert f"{cpu_kernels.ENV}=sse9 is not a kernel level" in line


def _installation_without(tmp_path: Path, libraries: str) -> dict[str, str]:
    """An environment whose llmcli is a copy of this one less the libraries matching `libraries`:
    an installation built where some level (or every one) did not compile."""
    shutil.copytree(PACKAGE, tmp_path / "llmcli", ignore=shutil.ignore_patterns("__pycache__", libraries))
    return {"PYTHONPATH": str(tmp_path)}


def test_a_level_this_installation_lacks_is_refused_in_one_line(tmp_path: Path) -> None:
    if "avx512" not in cpu_kernels.built_levels():
        pytest.skip("this installation holds no avx512 kernels to take away")
    env = {**_installation_without(tmp_path, "_cpu_avx512.*"), cpu_kernels.ENV: "avx512"}
    line = one_error_line(run_cli("generate", "-m", "/nonexistent/model", "hi", env=env), 2)
    built = ", ".join(level for level in cpu_kernels.built_levels() if level != "avx512")
    assert line.endswith(
        f"{cpu_kernels.ENV}=avx512: this installation has no avx512 kernels (built: {built})"
    )


@pytest.mark.parametrize("level", [level for level in cpu_kernels.LEVELS if level != "portable"])
def test_a_level_this_cpu_cannot_run_is_refused_never_run(level: str) -> None:
    """Where the CPU lacks what a level was compiled for (as the portable build reads the CPU),
    forcing it is one line naming what is missing — never an illegal instruction."""
    if level not in cpu_kernels.built_levels() or cpu_kernels.runs_here(level):
        pytest.skip(f"this CPU runs the {level} kernels (or none were built)")
    line = one_error_line(
        run_cli("generate", "-m", "/nonexistent/model", "hi", env={cpu_kernels.ENV: level}), 2
    )
    lacking = ", ".join(cpu_kernels.missing_features(level))
    assert lacking and line.endswith(
        f"{cpu_kernels.ENV}={level}: this CPU cannot run them (it lacks {lacking})"
    )
    assert _which("auto").stdout.strip() != f"llmcli {level}"


def _generate_json(model: Path, env: dict[str, str]) -> tuple[dict[str, object], str]:
    proc = run_cli("generate", "-m", str(model), "--device", "cpu", "-n", "1", "--json", "hi", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout), proc.stderr.decode()


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="no GGUF fixtures here")
def test_json_names_the_kernels_and_a_build_without_them_says_so_once(tmp_path: Path) -> None:
    model = FIXTURES / "fixture-Q6_K.gguf"  # a type `auto` gives the kernels
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    record, err = _generate_json(model, cache)
    assert record["cpu_kernels"] == f"llmcli {LEVELS[0]}" and "compiled" not in err
    four_bit, _ = _generate_json(FIXTURES / "fixture-Q4_0.gguf", cache)  # one torch's path holds as well
    assert str(four_bit["cpu_kernels"]).startswith("torch (this model's layers")
    bare = {**cache, **_installation_without(tmp_path / "bare", "_cpu_*")}
    record, err = _generate_json(model, bare)
    assert str(record["cpu_kernels"]).startswith("torch (llmcli was installed without its compiled kernels")
    assert err.count("installed without its compiled CPU kernels") == 1, err
