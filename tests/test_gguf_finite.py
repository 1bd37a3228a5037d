"""A GGUF file whose blocks hold a NaN or Inf scale, or whose float tensors hold a NaN or Inf
value, is named in one line at load (models/gguf_finite.py), tensor and block; llama.cpp's own
files pass. Each scale field's place is checked against gguf's own dequantization: the field
set to NaN makes exactly that block's values non-finite."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gguf_fixtures_dir import FIXTURES, MISSING
from llmcli.errors import ModelLoadError
from llmcli.models import gguf_finite
from llmcli.models.gguf_finite import BLOCK_SCALES, FLOATS, check_finite
from llmcli.models.gguf_table import TableEntry, read_table

from cli_helpers import one_error_line, run_cli

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=MISSING)
FILES = sorted(FIXTURES.glob("fixture-*.gguf")) if FIXTURES.is_dir() else []
NAN = {2: b"\x00\x7e", 4: b"\x00\x00\xc0\x7f", 1: b"\xff"}  # fp16 / fp32 NaN, E8M0's NaN
INF = {2: b"\x00\x7c", 4: b"\x00\x00\x80\x7f"}


def _one_of_each_type() -> dict[str, tuple[Path, str]]:
    """A tensor of each type the fixtures hold: (its file, its name)."""
    found: dict[str, tuple[Path, str]] = {}
    for path in FILES:
        for entry in read_table(path).tensors.values():
            found.setdefault(entry.type_name, (path, entry.name))
    return found


TYPES = _one_of_each_type() if FIXTURES.is_dir() else {}
FIELDS = [
    (type_name, offset, kind.dtype)
    for type_name, (_, scales) in BLOCK_SCALES.items()
    if type_name in TYPES
    for offset, kind in scales
]


def test_the_block_layouts_are_ggmls() -> None:
    for type_name, (block_bytes, _) in BLOCK_SCALES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1] == block_bytes, type_name


@pytest.mark.parametrize("path", FILES, ids=[path.stem for path in FILES])
def test_llama_cpps_own_files_pass(path: Path) -> None:
    check_finite(read_table(path))


def _damaged(tmp_path: Path, type_name: str, offset_in: int, raw: bytes) -> tuple[Path, TableEntry]:
    """A copy of the fixture holding a `type_name` tensor, with `raw` written `offset_in` bytes
    into that tensor."""
    source, name = TYPES[type_name]
    copy = tmp_path / source.name
    shutil.copyfile(source, copy)
    entry = read_table(copy).tensors[name]
    with copy.open("r+b") as handle:
        handle.seek(entry.start + offset_in)
        handle.write(raw)
    return copy, entry


@pytest.mark.parametrize(("type_name", "offset", "dtype"), FIELDS)
def test_a_nan_scale_is_named_with_its_tensor_and_block(
    tmp_path: Path, type_name: str, offset: int, dtype: str
) -> None:
    block_bytes = BLOCK_SCALES[type_name][0]
    block = 5
    copy, entry = _damaged(tmp_path, type_name, block * block_bytes + offset, NAN[np.dtype(dtype).itemsize])
    raw = np.fromfile(copy, np.uint8, count=entry.nbytes, offset=entry.start)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    per_block = values.size // (entry.nbytes // block_bytes)
    broken = np.flatnonzero(~np.isfinite(values)) // per_block
    assert set(broken.tolist()) == {block}  # the field is this block's scale, as gguf reads it
    with pytest.raises(ModelLoadError, match=rf"tensor {entry.name}, block {block} "):
        check_finite(read_table(copy))


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("type_name", [name for name in FLOATS if name in TYPES])
def test_an_inf_value_of_a_float_tensor_is_named(
    tmp_path: Path, type_name: str, chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chunk`: values read a few at a time, so that the one found is past the first chunk."""
    if chunk is not None:
        monkeypatch.setattr(gguf_finite, "_CHUNK", chunk)
    size = 4 if type_name == "F32" else 2
    inf = INF[4][2:] if type_name == "BF16" else INF[size]  # bf16 is fp32's upper half
    copy, entry = _damaged(tmp_path, type_name, 7 * size, inf)
    with pytest.raises(ModelLoadError, match=rf"tensor {entry.name}, value 7 "):
        check_finite(read_table(copy))


def test_generate_names_the_damaged_file_in_one_line(tmp_path: Path) -> None:
    copy, entry = _damaged(tmp_path, "Q4_0", 3 * 18, NAN[2])
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = run_cli("generate", "-m", str(copy), "-n", "1", "hi", env=env)  # its tokenizer read once, said
    assert first.returncode == 1 and b"Traceback" not in first.stderr
    line = one_error_line(run_cli("generate", "-m", str(copy), "-n", "1", "hi", env=env), 1)
    assert f"{copy} holds a NaN or Inf scale: tensor {entry.name}, block 3" in line
