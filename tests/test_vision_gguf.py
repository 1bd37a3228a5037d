"""A GGUF model with its vision part in llama.cpp's projector file (mmproj): Qwen3.5's decoder
read in place, its tower from the mmproj found beside it or named by --mmproj, replying with an
image exactly as the checkpoint folder the two files were written from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gguf_qwen35 import write_qwen35_gguf
from mmproj_files import write_mmproj
from test_vision_engine import png

from cli_helpers import one_error_line, run_cli
from tiny_models import build_tiny_model

pytest.importorskip("gguf")


def text_part(folder: Path, target: Path) -> Path:
    """The vision-language checkpoint's language model as a text checkpoint (what llama.cpp's
    converter writes the model GGUF from)."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    whole = json.loads((folder / "config.json").read_text())
    config = whole["text_config"] | {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
        config.setdefault(key, whole.get(key))
    (target / "config.json").write_text(json.dumps(config))
    inner = "model.language_model."
    weights = {
        ("model." + name[len(inner) :] if name.startswith(inner) else name): tensor
        for name, tensor in load_file(folder / "model.safetensors").items()
        if not name.startswith("model.visual.")
    }
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    for file in folder.iterdir():
        if file.name.startswith("tokenizer") or file.name in (
            "chat_template.jinja",
            "generation_config.json",
        ):
            shutil.copy(file, target / file.name)
    return target


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the folder, its GGUF with the mmproj beside it, another mmproj copy elsewhere)."""
    import transformers

    root = tmp_path_factory.mktemp("vision-gguf")
    folder = build_tiny_model(root / "folder", "qwen3_5_vl")
    models = root / "models"
    models.mkdir()
    model_file = write_qwen35_gguf(text_part(folder, root / "text"), models / "tiny-qwen35.gguf")
    whole = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    budget = json.loads((folder / "preprocessor_config.json").read_text())["size"]
    pixels = (
        budget["shortest_edge"],
        budget["longest_edge"],
    )  # the tiny tower's, as the converter copies them
    write_mmproj(whole, models / "mmproj-tiny-f32.gguf", pixels=pixels)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(models / "mmproj-tiny-f32.gguf", elsewhere / "vision.gguf")
    return folder, model_file, elsewhere / "vision.gguf"


def reply(model: Path, picture: Path, *extra: str) -> dict:
    args = ("-t", "0", "-n", "4", "--json", "--image", str(picture), *extra, "describe it")
    proc = run_cli("generate", "-m", str(model), *args)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_the_mmproj_beside_a_gguf_reads_images_as_the_folder(
    files: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    folder, model_file, elsewhere = files
    picture = tmp_path / "photo.png"
    picture.write_bytes(png(33, 21, 3))
    expected = reply(folder, picture)
    found = reply(model_file, picture)
    assert (found["text"], found["prompt_tokens"], found["image_tokens"]) == (
        expected["text"],
        expected["prompt_tokens"],
        expected["image_tokens"],
    )
    named = reply(model_file, picture, "--mmproj", str(elsewhere))
    assert named["text"] == expected["text"]


def test_a_wrong_mmproj_is_refused_in_one_line(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    folder, model_file, _ = files
    picture = tmp_path / "photo.png"
    picture.write_bytes(png(20, 20, 1))
    line = one_error_line(run_cli("generate", "-m", str(folder), "--mmproj", str(model_file), "hi"), 2)
    assert "--mmproj" in line and "GGUF" in line
    line = one_error_line(run_cli("generate", "-m", str(model_file), "--mmproj", str(model_file), "hi"), 1)
    assert str(model_file) in line
