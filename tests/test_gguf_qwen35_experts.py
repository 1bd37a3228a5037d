"""Qwen3.5-MoE and Qwen3-Next GGUF files (llama.cpp's `qwen35moe` and `qwen3next`), written as
llama.cpp's converter writes them (tests/gguf_qwen35.py: experts stacked, Qwen3-Next's
in_proj_qkvz split in two), read in place: the native engine's logits equal to the same model's
from its folder in fp32, greedy tokens equal, transformers' path too, and a file missing an
expert's tensor or whose expert metadata contradicts it named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_qwen35 import q8_0_exact, tiny_qwen35, write_qwen35_gguf
from test_gguf_qwen35 import greedy, ids, load

from cli_helpers import one_error_line, run_cli

ARCHES = {"qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}  # llama.cpp's name → tiny_models'
CLASSES = {"qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("models")
    return {name: tiny_qwen35(where / arch, arch) for name, arch in ARCHES.items()}


@pytest.fixture(scope="module")
def gguf_files(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Path]:
    where = tmp_path_factory.mktemp("gguf")
    return {
        (name, kind): write_qwen35_gguf(folder, where / f"{name}-{kind}.gguf", half=kind == "F16")
        for name, folder in folders.items()
        for kind in ("F32", "F16")
    }


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind", ["F32", "F16"])
@pytest.mark.parametrize("name", ["qwen35moe", "qwen3next"])
def test_a_file_is_read_in_place_and_runs_as_its_folder(
    name: str, kind: str, folders: dict[str, Path], gguf_files: dict[tuple[str, str], Path]
) -> None:
    """Its experts (stacked in the file, gate and up joined on reading), shared expert and, for
    Qwen3-Next, its input projections put back together: every position's logits within 1e-5
    of the folder's, and 32 greedy tokens equal."""
    from llmcli.engine.native.backend import NativeBackend

    loaded = load(gguf_files[name, kind])
    assert getattr(loaded.model, "architecture", None) == CLASSES[name]
    reference = load(folders[name]).model
    prompt = ids(80, seed=2)  # longer than a chunk of the DeltaNet's rule (64)
    ours, our_tokens = greedy(loaded.model, prompt, 32)
    theirs, their_tokens = greedy(reference, prompt, 32)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert our_tokens == their_tokens
    rows = NativeBackend(loaded.model, 256).score(prompt)
    assert (rows - NativeBackend(reference, 256).score(prompt)).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["qwen35moe", "qwen3next"])
def test_a_q8_0_file_reads_its_experts_and_joined_projections_through_their_values(
    name: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """A quantized file's stacked experts and Qwen3-Next's split projections are dequantized and
    joined (never taken as blocks: they are not the model's matrices as stored). Dequantized
    (--quant none) the file is its folder's model exactly; as int8 (the default) its top tokens
    are the folder's (0.94 and 0.95 of them, measured)."""
    import shutil

    from llmcli.engine.native.backend import NativeBackend

    exact = q8_0_exact(Path(shutil.copytree(folders[name], tmp_path / "q8_0-exact")))
    path = write_qwen35_gguf(exact, tmp_path / f"{name}-Q8_0.gguf", q8_0=True)
    prompt = ids(80, seed=5)
    reference = load(exact).model
    expected, their_tokens = greedy(reference, prompt, 16)
    ours, our_tokens = greedy(load(path, quant="none").model, prompt, 16)
    assert (ours - expected).abs().max().item() < 1e-5 and our_tokens == their_tokens
    rows = NativeBackend(load(path).model, 256).score(prompt).argmax(-1)
    agree = (rows == NativeBackend(reference, 256).score(prompt).argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("name", ["qwen35moe", "qwen3next"])
def test_transformers_path_reads_the_file_as_its_folder(
    name: str, folders: dict[str, Path], gguf_files: dict[tuple[str, str], Path]
) -> None:
    """transformers' model (its experts as one gate_up_proj, Qwen3-Next's in_proj_qkvz and
    in_proj_ba) filled from the file: its logits transformers' own on the folder."""
    from transformers import AutoModelForCausalLM

    loaded = load(gguf_files[name, "F32"], engine="transformers")
    assert type(loaded.model).__name__ == CLASSES[name]
    reference = AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
    prompt = torch.tensor([ids(40, seed=6)])
    with torch.inference_mode():
        assert (loaded.model(prompt).logits - reference(prompt).logits).abs().max().item() < 1e-5


_SHAPE = "tensor blk.0.{} has the shape {}, where its metadata implies {} (by its {})"
_DAMAGED = [
    ("qwen35moe", "blk.1.ffn_gate_exps.weight", "tensor blk.1.ffn_gate_exps.weight is missing"),
    ("qwen35moe", "blk.0.ffn_gate_inp_shexp.weight", "tensor blk.0.ffn_gate_inp_shexp.weight is missing"),
    ("qwen3next", "blk.0.ssm_ba.weight", "tensor blk.0.ssm_ba.weight is missing"),
    ("qwen3next", "blk.1.ffn_down_exps.weight", "tensor blk.1.ffn_down_exps.weight is missing"),
    (
        "qwen35moe",
        {"qwen35moe.expert_count": 8},
        _SHAPE.format("ffn_gate_inp.weight", [4, 64], [8, 64], "expert_count"),
    ),
    (
        "qwen3next",
        {"qwen3next.expert_feed_forward_length": 16},
        _SHAPE.format(
            "ffn_down_exps.weight", [4, 64, 32], [4, 64, 16], "expert_count and expert_feed_forward_length"
        ),
    ),
    (
        "qwen35moe",
        {"qwen35moe.expert_shared_feed_forward_length": 32},
        _SHAPE.format("ffn_down_shexp.weight", [64, 96], [64, 32], "expert_shared_feed_forward_length"),
    ),
    (
        "qwen3next",
        {"qwen3next.expert_used_count": 5},
        "its expert_used_count (5) is more than its expert_count (4)",
    ),
    (
        "qwen35moe",
        {"qwen35moe.expert_shared_feed_forward_length": None},
        "its metadata lacks a positive expert_shared_feed_forward_length",
    ),
]


@pytest.mark.parametrize(("name", "change", "says"), _DAMAGED)
def test_a_file_contradicting_itself_is_named_in_one_line(
    name: str, change: dict | str, says: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """An expert's or shared expert's tensor missing, or expert counts and widths its tensors (or
    each other) contradict: one line naming the tensor and the setting, before anything runs."""
    metadata = change if isinstance(change, dict) else {}
    damaged = write_qwen35_gguf(
        folders[name], tmp_path / "damaged.gguf", metadata=metadata, keep=lambda tensor: tensor != change
    )
    line = one_error_line(run_cli("generate", "-m", str(damaged), "--engine", "native", "-n", "2", "hi"), 1)
    assert "damaged.gguf" in line and says in line, line


@pytest.mark.parametrize("name", ["qwen35moe", "qwen3next"])
def test_the_files_weights_are_counted_once_as_the_model_holds_them(
    name: str, folders: dict[str, Path], gguf_files: dict[tuple[str, str], Path]
) -> None:
    """What memory estimates and the DeltaNet's checks read (Checkpoint.shapes): the joined
    tensors under transformers' names, their parts not counted beside them."""
    from safetensors.torch import load_file

    from llmcli.models.gguf_direct import shapes_of_table
    from llmcli.models.gguf_table import read_table

    shapes = shapes_of_table(read_table(gguf_files[name, "F32"]))
    assert "model.layers.1.mlp.experts.gate_up_proj" in shapes
    assert ("model.layers.0.linear_attn.in_proj_qkvz.weight" in shapes) == (name == "qwen3next")
    counted = sum(torch.Size(header.shape).numel() for header in shapes.values())
    assert counted == sum(
        tensor.numel() for tensor in load_file(folders[name] / "model.safetensors").values()
    )


def test_a_qwen35moe_file_with_an_mtp_block_runs_as_its_folder(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """The converter writes Qwen3.5-MoE's MTP layer (with its experts) as a block past the
    model's own, as Qwen3.5's: not read yet, the model its blocks before it."""
    path = write_qwen35_gguf(folders["qwen35moe"], tmp_path / "qwen35moe-MTP.gguf", mtp=True)
    prompt = ids(40, seed=7)
    ours, our_tokens = greedy(load(path).model, prompt, 16)
    theirs, their_tokens = greedy(load(folders["qwen35moe"]).model, prompt, 16)
    assert (ours - theirs).abs().max().item() < 1e-5 and our_tokens == their_tokens
