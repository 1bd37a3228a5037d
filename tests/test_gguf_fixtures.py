"""llama.cpp's own GGUF fixtures (../shared/gguf-fixtures, beside the checkout): llmcli's logits on
each file against llama.cpp's on the same file. Skipped where the fixtures are not there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llama_cpp_reference import kl_and_top1, perplexity

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "gguf-fixtures"
NATIVE_HALF = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def fixture(name: str) -> Path:
    path = FIXTURES / f"fixture-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's GGUF fixtures are not beside the checkout ({FIXTURES})")
    return path


@pytest.mark.parametrize(("kind", "dtype"), [("F16", "fp16"), ("BF16", "bf16")])
def test_a_16_bit_gguf_is_held_in_its_16_bits_and_matches_llama_cpp(
    kind: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU whose torch multiplies 16-bit matrices natively, an F16 (BF16) file's weights are
    held as fp16 (bf16), about the file's size, not widened to fp32; elsewhere fp32. Either way
    its logits on the fixture's text are llama.cpp's on the same file: mean KL under 1e-3 nats,
    perplexity within 0.5 %."""
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.loop import Engine
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    path = fixture(kind)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its conversion in a cache of its own
    reference = np.load(path.with_name(f"fixture-{kind}.reference.npz"))
    loaded = load_model(resolve_model(str(path)), LoadSettings(device="cpu"))
    assert loaded.dtype_name == (dtype if NATIVE_HALF else "fp32")
    if NATIVE_HALF:
        assert loaded.weight_bytes <= 1.1 * path.stat().st_size
    engine = Engine.for_loaded(loaded)
    with torch.inference_mode():
        logits = engine.backend.score([int(i) for i in reference["ids"]]).float()
    kl, top1 = kl_and_top1(reference["logits"], logits)
    assert kl < 1e-3 and top1 >= 0.95
    ours, theirs = (
        perplexity(logits, reference["ids"]),
        perplexity(torch.from_numpy(reference["logits"]), reference["ids"]),
    )
    assert abs(ours / theirs - 1) < 0.005


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1"])
def test_4_bit_blocks_read_as_int4_codes_are_bit_equal_to_ggufs_dequantization(kind: str) -> None:
    """Every Q4_0, Q4_1 and Q4_K tensor of llama.cpp's files, read as llmcli's int4 codes with a
    scale and zero point per group of 32, gives exactly the weights gguf's own dequantization
    gives, in fp32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    from llmcli.models.gguf_int4 import codes_of, dequantize

    checked = 0
    for tensor in GGUFReader(str(fixture(kind))).tensors:
        if tensor.tensor_type.name not in ("Q4_0", "Q4_1", "Q4_K") or len(tensor.shape) != 2:
            continue
        in_features, out_features = (int(n) for n in tensor.shape)
        codes, scale, zero = codes_of(tensor.data, tensor.tensor_type.name, out_features, in_features)
        ours = dequantize(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scale, zero)))
        exact = gguf_dequantize(tensor.data, tensor.tensor_type).reshape(out_features, in_features)
        assert torch.equal(ours, torch.from_numpy(exact.astype(np.float32))), tensor.name
        checked += 1
    assert checked >= 12  # every layer's 4-bit projections at least
