"""Gemma 4 GGUF files (llama.cpp's `gemma4`), written as llama.cpp's converter writes them
(tests/gguf_gemma4.py), read in place: the native engine's logits equal to the same model's from
its folder in fp32, greedy tokens equal, and a file whose metadata contradicts its tensors, or
that lacks one, named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_gemma4 import write_gemma4_gguf
from test_gguf_qwen35 import VOCAB, greedy

from cli_helpers import one_error_line, run_cli
from tiny_models import build_tiny_model

VARIANTS = {"dense": "gemma4", "moe": "gemma4_moe"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny dense model and the one with experts (tests/tiny_models.py's GEMMA4_VARIANTS)."""
    where = tmp_path_factory.mktemp("models")
    return {variant: build_tiny_model(where / arch, arch) for variant, arch in VARIANTS.items()}


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "llmcli" / "gguf"


def load(path: Path, engine: str = "native"):
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    settings = LoadSettings(device="cpu", dtype="fp32", threads=1, engine=engine, quant="auto")
    return load_model(resolve_model(str(path)), settings, lean=True)


@pytest.mark.parametrize(("variant", "half"), [("dense", False), ("dense", True), ("moe", False)])
def test_a_file_is_read_in_place_and_runs_as_its_folder(
    variant: str, half: bool, folders: dict[str, Path], tmp_path: Path, own_cache: Path
) -> None:
    """An F32 file, dense or with experts, is its folder's model (logits within 1e-5, a prompt
    past the sliding window); an F16 one is the folder's model with its matrices rounded to F16,
    as the file holds them."""
    folder = folders[variant]
    path = write_gemma4_gguf(folder, tmp_path / "gemma4.gguf", half=half)
    loaded = load(path)
    assert getattr(loaded.model, "architecture", None) == "Gemma4ForCausalLM"
    (written,) = [f for f in own_cache.iterdir() if not f.name.startswith(".")]
    assert not list(written.rglob("*.safetensors"))  # its weights are the file's own
    reference = load(folder).model
    if half:  # the folder's matrices rounded as the file holds them
        with torch.no_grad():
            for parameter in reference.parameters():
                if parameter.ndim >= 2:
                    parameter.copy_(parameter.half().float())
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, our_tokens = greedy(loaded.model, prompt, 24)
    theirs, their_tokens = greedy(reference, prompt, 24)
    assert (ours - theirs).abs().max().item() < (1e-4 if half else 1e-5)
    assert our_tokens == their_tokens


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_transformers_path_reads_the_file_as_its_folder(
    variant: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """On transformers (--engine transformers, and beam search): built from the file's config,
    its logits transformers' own on the folder."""
    from transformers import AutoModelForCausalLM

    path = write_gemma4_gguf(folders[variant], tmp_path / "gemma4.gguf")
    loaded = load(path, engine="transformers")
    assert type(loaded.model).__name__ == "Gemma4ForCausalLM"
    reference = AutoModelForCausalLM.from_pretrained(folders[variant], dtype=torch.float32).eval()
    prompt = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert (loaded.model(prompt).logits - reference(prompt).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("variant", "change", "says"),
    [
        ("dense", {"gemma4.attention.sliding_window_pattern": [True, False]},
         "its attention.sliding_window_pattern"),
        ("dense", {"gemma4.attention.shared_kv_layers": 6},
         "its attention.shared_kv_layers (6) is not fewer than"),
        ("dense", {"gemma4.feed_forward_length": [128] * 6}, "tensor blk.4.ffn_down.weight has the shape "
         "[64, 256], where its metadata implies [64, 128]"),
        ("dense", {"gemma4.feed_forward_length": [128, 256] * 3}, "its feed_forward_length ([128, 256, 128, "
         "256, 128, 256])"),
        ("dense", {"gemma4.attention.key_length": 16}, "blk.1."),
        ("dense", "blk.0.attn_k.weight", "blk.0.attn_k.weight"),
        ("dense", "output_norm.weight", "tensor output_norm.weight is missing"),
        ("dense", "blk.1.layer_output_scale.weight", "tensor blk.1.layer_output_scale.weight is missing"),
        ("moe", "blk.2.ffn_down_exps.scale", "tensor blk.2.ffn_down_exps.scale is missing"),
        ("moe", {"gemma4.expert_feed_forward_length": 16}, "tensor blk.0.ffn_down_exps.weight has the shape "
         "[4, 64, 32], where its metadata implies [4, 64, 16]"),
    ],
)  # fmt: skip
def test_a_file_contradicting_itself_is_named_in_one_line(
    variant: str, change: dict | str, says: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """Metadata the tensors or the other settings contradict, or a tensor missing: one line
    naming the file and the tensor or setting, before anything runs."""
    metadata = change if isinstance(change, dict) else {}
    damaged = write_gemma4_gguf(
        folders[variant], tmp_path / "damaged.gguf", metadata=metadata, keep=lambda name: name != change
    )
    line = one_error_line(run_cli("generate", "-m", str(damaged), "--engine", "native", "-n", "2", "hi"), 1)
    assert "damaged.gguf" in line and says in line, line


def test_a_quantized_file_is_refused_in_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    """Not read yet (the native Gemma 4 engine keeps no quantized embedding), and transformers'
    converter fails on these files: named, rather than an unexpected error."""
    path = write_gemma4_gguf(folders["dense"], tmp_path / "quantized.gguf", q8_0=True)
    line = one_error_line(run_cli("generate", "-m", str(path), "-n", "2", "hi"), 1)
    assert "quantized.gguf: a quantized Gemma 4 file (tensor" in line and "Q8_0" in line, line
