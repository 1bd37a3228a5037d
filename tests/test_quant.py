"""Quantized loading with bitsandbytes on CPU, memory accounting, and the fit check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engines import engine_for
from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.conversation import build_messages, prompt_ids
from llmcli.errors import LlmcliError
from llmcli.models.load import load_model
from llmcli.models.memory import (
    FitRequest,
    estimate_weight_bytes,
    fits,
    kv_bytes_per_token,
    weight_shapes,
)
from llmcli.models.resolve import ResolvedModel

from cli_helpers import PATIENCE_S, run_cli

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install 'llmcli[quant]'")

VARIANTS = [("none", "nf4"), ("int8", "nf4"), ("int4", "nf4"), ("int4", "fp4")]


def load_variant(folder: Path, quant: str, quant_type: str = "nf4", double_quant: bool = True):
    """Quantized by bitsandbytes: --engine transformers keeps --quant int8/int4 off the native path."""
    settings = LoadSettings(
        device="cpu", quant=quant, quant_type=quant_type, double_quant=double_quant, engine="transformers"
    )
    return load_model(ResolvedModel(name=folder.name, path=folder, source="folder"), settings)


def linear_layer_bytes(model) -> int:
    """Bytes held by the decoder's linear layers only (attention and MLP projections)."""
    from llmcli.models.memory import measured_weight_bytes

    return sum(
        measured_weight_bytes(module)
        for name, module in model.named_modules()
        if name.endswith(("_proj", "fc1", "fc2")) and not list(module.children())
    )


@pytest.fixture(scope="module")
def demo_folder(loaded_demo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model saved as a safetensors folder (fp32), for bitsandbytes to quantize: a GGUF
    file itself is not re-quantized (it is refused)."""
    folder = tmp_path_factory.mktemp("demo-folder")
    loaded_demo.model.save_pretrained(folder)
    loaded_demo.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_variants(tiny_llama: Path):
    return {f"{quant}-{kind}": load_variant(tiny_llama, quant, kind) for quant, kind in VARIANTS}


def test_quantized_linear_layers_shrink_as_expected(tiny_variants) -> None:
    fp32 = linear_layer_bytes(tiny_variants["none-nf4"].model)
    int8 = linear_layer_bytes(tiny_variants["int8-nf4"].model)
    nf4 = linear_layer_bytes(tiny_variants["int4-nf4"].model)
    fp4 = linear_layer_bytes(tiny_variants["int4-fp4"].model)
    assert nf4 < int8 < fp32 and fp4 < int8
    assert 0.24 < int8 / fp32 < 0.30  # 1 byte of 4, plus a scale per row
    # Half a byte of 4, plus an absmax per block of 64 and a small codebook per layer (which
    # weighs more in these 64-wide layers than in a real model's).
    assert 0.12 < nf4 / fp32 < 0.20
    labels = {name: loaded.quant for name, loaded in tiny_variants.items()}
    assert labels == {"none-nf4": "none", "int8-nf4": "int8", "int4-nf4": "int4-nf4", "int4-fp4": "int4-fp4"}


def test_quantized_tiny_models_generate(tiny_variants) -> None:
    for name, loaded in tiny_variants.items():
        ids = prompt_ids(loaded.tokenizer, build_messages("Hello"))
        engine = engine_for(loaded, frozenset(), loaded.context_length)
        generation = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=8), loaded.tokenizer)
        list(generation)
        assert len(generation.result.token_ids) == 8, name


@pytest.mark.demo
@pytest.mark.parametrize(("quant", "quant_type"), [("int8", "nf4"), ("int4", "nf4"), ("int4", "fp4")])
def test_quantized_demo_model_still_answers(demo_folder: Path, quant: str, quant_type: str) -> None:
    loaded = load_variant(demo_folder, quant, quant_type)
    ids = prompt_ids(loaded.tokenizer, build_messages("What is the capital of France?"))
    engine = engine_for(loaded, loaded.eos_token_ids, loaded.context_length)
    generation = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=24), loaded.tokenizer)
    list(generation)
    assert "Paris" in generation.result.text
    assert loaded.weight_bytes < 0.45 * 538_060_288  # the fp32 model's measured bytes


@pytest.mark.parametrize(
    ("quant", "double_quant"), [("none", True), ("int8", True), ("int4", True), ("int4", False)]
)
def test_estimate_from_headers_matches_the_loaded_model(
    tiny_llama: Path, quant: str, double_quant: bool
) -> None:
    loaded = load_variant(tiny_llama, quant, double_quant=double_quant)
    estimate = estimate_weight_bytes(weight_shapes(tiny_llama), 4, quant, double_quant)
    assert abs(estimate - loaded.weight_bytes) / loaded.weight_bytes < 0.03


@pytest.mark.demo
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_estimate_from_headers_matches_the_demo_model(demo_folder: Path, loaded_demo, quant: str) -> None:
    measured = loaded_demo.weight_bytes if quant == "none" else load_variant(demo_folder, quant).weight_bytes
    estimate = estimate_weight_bytes(weight_shapes(demo_folder), 4, quant)
    assert abs(estimate - measured) / measured < 0.03


def test_kv_bytes_per_token_matches_a_real_cache(loaded_tiny) -> None:
    config = json.loads((Path(loaded_tiny.model.name_or_path) / "config.json").read_text())
    per_token = kv_bytes_per_token(config, 4)
    assert per_token == loaded_tiny.kv_bytes_per_token
    engine = engine_for(loaded_tiny, backend="transformers")
    engine.prefill(list(range(10, 60)))
    layers = engine.backend.cache.layers
    cached = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    assert cached == per_token * 50
    native = engine_for(loaded_tiny, backend="native").backend
    native.prefill(list(range(10, 60)))
    cache = native.cache
    held = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
    assert held == per_token * cache.capacity


def fit_request(folder: Path, budget: int, quant: str = "none", context: int = 1024, given: bool = False):
    shapes = weight_shapes(folder)
    config = json.loads((folder / "config.json").read_text())
    return FitRequest(
        name=folder.name,
        device="cuda:0",
        shapes=shapes,
        dtype_bytes=2,
        dtype_name="bf16",
        quant=quant,
        double_quant=True,
        weight_bytes=estimate_weight_bytes(shapes, 2, quant, True, "cuda"),
        kv_per_token=kv_bytes_per_token(config, 2),
        context=context,
        context_given=given,
        budget=budget,
    )


def needed(folder: Path, quant: str, tokens: int) -> int:
    config = json.loads((folder / "config.json").read_text())
    return estimate_weight_bytes(weight_shapes(folder), 2, quant) + kv_bytes_per_token(config, 2) * tokens


def test_fit_check_with_room_keeps_the_context(tiny_llama: Path) -> None:
    assert fits(fit_request(tiny_llama, budget=2 * needed(tiny_llama, "none", 1024))) == (1024, None)


def test_fit_check_lowers_a_context_nobody_asked_for(tiny_llama: Path) -> None:
    budget = int(needed(tiny_llama, "none", 40_000) / 0.9)
    context, note = fits(fit_request(tiny_llama, budget, context=131_072))
    assert 2048 <= context < 40_000 + 256 and context % 256 == 0
    assert note and f"Context limited to {context} tokens" in note


def test_fit_check_suggests_the_nearest_option(tiny_llama: Path) -> None:
    budget = int(needed(tiny_llama, "none", 40_000) / 0.9)
    with pytest.raises(LlmcliError) as asked_for:
        fits(fit_request(tiny_llama, budget, context=131_072, given=True))
    assert "try --ctx" in asked_for.value.one_line()

    between = int(needed(tiny_llama, "int8", 1024) / 0.9) + 1
    assert between < needed(tiny_llama, "none", 1024)
    with pytest.raises(LlmcliError) as too_big:
        fits(fit_request(tiny_llama, between, context=1024, given=True))
    line = too_big.value.one_line()
    assert "needs" in line and "KV cache for 1024 tokens" in line and "try --quant int8" in line

    tiny_budget = needed(tiny_llama, "int4", 0) // 2
    with pytest.raises(LlmcliError) as nothing_fits:
        fits(fit_request(tiny_llama, tiny_budget, context=1024, given=True))
    assert "try --offload" in nothing_fits.value.one_line()


@pytest.mark.demo
def test_max_memory_refuses_with_numbers_and_a_suggestion(demo_folder: Path) -> None:
    proc = run_cli("generate", "-m", str(demo_folder), "--max-memory", "400MB", "hi")
    err = proc.stderr.decode()
    assert proc.returncode == 1 and err.count("\n") == 1
    assert (
        "538.1 MB of weights (fp32)" in err
        and "400.0 MB is available on cpu" in err
        and "--quant int8" in err
    )


@pytest.mark.demo
def test_max_memory_lowers_the_context_and_says_so(demo_folder: Path) -> None:
    proc = run_cli(
        "generate", "-m", str(demo_folder), "--max-memory", "800MB", "--json", "-t", "0", "-n", "4", "hi"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert 2048 <= record["context_length"] < 8192
    assert f"Context limited to {record['context_length']} tokens" in proc.stderr.decode()


def test_quant_with_a_gguf_file_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    proc = run_cli("generate", "-m", str(fake), "--quant", "nf4", "hi")
    # The file is not even readable as GGUF: the refusal must come before any attempt to read it.
    assert proc.returncode == 2
    assert "(bitsandbytes) does not apply to a GGUF file" in proc.stderr.decode()


def test_quant_without_bitsandbytes_is_one_clear_line(tiny_llama: Path) -> None:
    hide = "import sys; sys.modules['bitsandbytes'] = None; from llmcli.cli import main; main()"
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", hide, "generate", "-m", str(tiny_llama), "--quant", "nf4", "hi"],
        capture_output=True,
        timeout=PATIENCE_S,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 1 and err.count("\n") == 1
    assert "--quant nf4 needs the bitsandbytes package" in err


def test_quant_on_a_prequantized_checkpoint_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    loaded = load_variant(tiny_llama, "int4")
    folder = tmp_path / "prequantized"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    as_is = run_cli("generate", "-m", str(folder), "--json", "-t", "0", "-n", "3", "hi")
    assert as_is.returncode == 0, as_is.stderr.decode()
    record = json.loads(as_is.stdout)
    assert record["quant"] == "bitsandbytes"
    stored = estimate_weight_bytes(weight_shapes(folder), 4, "stored")
    assert abs(stored - record["weight_bytes"]) / record["weight_bytes"] < 0.05
    again = run_cli("generate", "-m", str(folder), "--quant", "int8", "hi")
    assert again.returncode == 2 and "already quantized (bitsandbytes)" in again.stderr.decode()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_load_on_gpu(tiny_llama: Path, quant: str) -> None:
    settings = LoadSettings(device="cuda", quant=quant, engine="transformers")  # bitsandbytes
    loaded = load_model(ResolvedModel(name="tiny", path=tiny_llama, source="folder"), settings)
    assert loaded.device.type == "cuda" and loaded.quant.startswith(quant)
    engine = engine_for(loaded, frozenset(), loaded.context_length)
    generation = engine.generate(
        [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=8), loaded.tokenizer
    )
    list(generation)
    assert len(generation.result.token_ids) == 8


@pytest.mark.parametrize("quant", ["int8", "nf4"], ids=["native", "bitsandbytes"])
def test_quantized_generation_prints_nothing_but_the_text(tiny_llama: Path, quant: str) -> None:
    """bitsandbytes logs a line per matmul on CPU; none of it may reach the user."""
    proc = run_cli("generate", "-m", str(tiny_llama), "--quant", quant, "-t", "0", "-n", "6", "--raw", "hi")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr.decode() == ""
