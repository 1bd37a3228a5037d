"""Qwen3.5 GGUF files (llama.cpp's `qwen35`), written as llama.cpp's converter writes them
(tests/gguf_qwen35.py), read in place: their state-space tensors restored to transformers'
layout, the native engine's logits equal to the same model's from its folder in fp32, greedy
tokens equal, and a file whose metadata contradicts its tensors named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_qwen35 import q8_0_exact, tiny_qwen35, write_qwen35_gguf

from cli_helpers import one_error_line, run_cli

VOCAB = 400  # the tiny tokenizer's trained tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen35(tmp_path_factory.mktemp("models") / "qwen3_5")


@pytest.fixture(scope="module")
def gguf_files(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("gguf")
    return {
        "F32": write_qwen35_gguf(folder, where / "qwen35-F32.gguf"),
        "F16": write_qwen35_gguf(folder, where / "qwen35-F16.gguf", half=True),
        "F32 with an MTP block": write_qwen35_gguf(folder, where / "qwen35-MTP.gguf", mtp=True),
    }


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "llmcli" / "gguf"


def load(path: Path, engine: str = "native", quant: str = "auto"):
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    settings = LoadSettings(device="cpu", dtype="fp32", threads=1, engine=engine, quant=quant)
    return load_model(resolve_model(str(path)), settings, lean=True)


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The native engine's logits after `prompt`, and its next `steps` greedy tokens."""
    from llmcli.engine.native.backend import NativeBackend

    backend = NativeBackend(model, 256)
    with torch.inference_mode():
        logits = first = backend.prefill(prompt)
        produced: list[int] = []
        for _ in range(steps):
            produced.append(int(logits.argmax()))
            logits = backend.decode(torch.tensor([produced[-1]]))
    return first, produced


@pytest.mark.parametrize("kind", ["F32", "F16", "F32 with an MTP block"])
def test_a_file_is_read_in_place_and_runs_as_its_folder(
    kind: str, folder: Path, gguf_files: dict[str, Path], own_cache: Path
) -> None:
    """F32 and F16 files, and one with an MTP block after the model's own (as the converter
    writes Qwen3.5's MTP layer; not read yet: the model is its blocks before it)."""
    from llmcli.engine.native.backend import NativeBackend

    loaded = load(gguf_files[kind])
    assert getattr(loaded.model, "architecture", None) == "Qwen3_5ForCausalLM"
    (written,) = [f for f in own_cache.iterdir() if not f.name.startswith(".")]
    assert not list(written.rglob("*.safetensors"))  # its weights are the file's own
    reference = load(folder).model
    prompt = ids(80, seed=1)  # longer than a chunk of the DeltaNet's rule (64)
    ours, our_tokens = greedy(loaded.model, prompt, 32)
    theirs, their_tokens = greedy(reference, prompt, 32)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert our_tokens == their_tokens
    rows = NativeBackend(loaded.model, 256).score(prompt)  # every position, not only the last
    expected = NativeBackend(reference, 256).score(prompt)
    assert (rows - expected).abs().max().item() < 1e-5


def test_a_q8_0_file_reads_its_reordered_matrices_through_their_values(tmp_path: Path, folder: Path) -> None:
    """A quantized file's DeltaNet matrices, whose value heads the converter reordered, are read
    as their values and put back in order (never taken as their blocks: a block of 32 spans two
    heads of out_proj's columns). Dequantized (--quant none), the file is its folder's model
    exactly. As int8 (the default) its top tokens are the folder's: the other matrices' codes
    from their blocks, the reordered ones quantized from their values put back (taken as their
    blocks, 0.08 of the top tokens agreed, measured), its embedding kept in its blocks (which the
    Qwen3.5 runtime reads row by row, as the Llama one does)."""
    import shutil

    from llmcli.engine.native.backend import NativeBackend

    exact = q8_0_exact(Path(shutil.copytree(folder, tmp_path / "q8_0-exact")))
    path = write_qwen35_gguf(exact, tmp_path / "qwen35-Q8_0.gguf", q8_0=True)
    prompt = ids(80, seed=5)
    expected, their_tokens = greedy(load(exact).model, prompt, 16)
    ours, our_tokens = greedy(load(path, quant="none").model, prompt, 16)
    assert (ours - expected).abs().max().item() < 1e-5 and our_tokens == their_tokens
    int8 = load(path)
    assert type(int8.model.get_input_embeddings()).__name__ == "BlockEmbedding"
    rows = NativeBackend(int8.model, 256).score(prompt).argmax(-1)
    agree = (rows == NativeBackend(load(exact).model, 256).score(prompt).argmax(-1)).float().mean().item()
    print(f"int8 top-1 agreement: {agree:.3f}")
    assert agree >= 0.9


def test_transformers_path_reads_the_file_as_its_folder(folder: Path, gguf_files: dict[str, Path]) -> None:
    """On transformers (--engine transformers, and beam search): built from the file's config and
    its tensors restored, its logits transformers' own on the folder."""
    from transformers import AutoModelForCausalLM

    loaded = load(gguf_files["F32"], engine="transformers")
    assert type(loaded.model).__name__ == "Qwen3_5ForCausalLM"
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.tensor([ids(40, seed=4)])
    with torch.inference_mode():
        assert (loaded.model(prompt).logits - reference(prompt).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"qwen35.ssm.conv_kernel": 3}, "tensor blk.0.ssm_conv1d.weight has the shape [128, 4], where its "
         "metadata implies [128, 3] (by its ssm.conv_kernel"),
        ({"qwen35.ssm.state_size": 8}, "tensor blk.0.ssm_conv1d.weight has the shape [128, 4], where its "
         "metadata implies [96, 4] (by its ssm.conv_kernel, ssm.group_count, ssm.state_size"),
        ({"qwen35.ssm.time_step_rank": 3}, "its ssm.time_step_rank (3 value heads) is no multiple of "
         "ssm.group_count (2)"),
        ({"qwen35.ssm.inner_size": 62}, "its ssm.inner_size (62) is no whole number of its 4 value heads"),
        ({"qwen35.full_attention_interval": 0}, "its full_attention_interval (0) is no positive whole"),
        ({"qwen35.rope.dimension_count": 20}, "its rope.dimension_count (20) is no even part of a head's 16"),
        ({"qwen35.nextn_predict_layers": 2}, "its nextn_predict_layers (2) leaves no block of the model"),
        ({"qwen35.block_count": "two"}, "its metadata gives 'two' for qwen35.block_count, a whole number"),
        ({"qwen35.feed_forward_length": None}, "its metadata lacks qwen35.feed_forward_length"),
        ("blk.0.ssm_a", "tensor blk.0.ssm_a is missing"),
        ("blk.0.ssm_conv1d.weight", "tensor blk.0.ssm_conv1d.weight is missing"),
        ("blk.1.attn_q_norm.weight", "tensor blk.1.attn_q_norm.weight is missing"),
    ],
)  # fmt: skip
def test_a_file_contradicting_itself_is_named_in_one_line(
    change: dict | str, says: str, folder: Path, tmp_path: Path
) -> None:
    """A state size or convolution width in the metadata that the tensors contradict, sizes that
    contradict each other, or a layer's state-space tensor missing: one line naming the tensor
    and the setting, before anything runs."""
    metadata = change if isinstance(change, dict) else {}
    damaged = write_qwen35_gguf(
        folder, tmp_path / "damaged.gguf", metadata=metadata, keep=lambda name: name != change
    )
    line = one_error_line(run_cli("generate", "-m", str(damaged), "--engine", "native", "-n", "2", "hi"), 1)
    assert "damaged.gguf" in line and says in line, line


@pytest.mark.parametrize("architecture", ["nemotron_h", "granitehybrid"])
def test_a_hybrid_architecture_llmcli_cannot_run_yet_is_named_in_one_line(
    architecture: str, folder: Path, tmp_path: Path
) -> None:
    from gguf_files import rewrite_gguf

    source = write_qwen35_gguf(folder, tmp_path / "source.gguf")
    other = rewrite_gguf(source, tmp_path / f"{architecture}.gguf", architecture=architecture)
    line = one_error_line(run_cli("generate", "-m", str(other), "-n", "2", "hi"), 1)
    assert f"'{architecture}'" in line and "neither llmcli's engine nor transformers runs" in line
