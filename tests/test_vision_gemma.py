"""Gemma 3's and Gemma 4's vision parts (models/vision/gemma3.py, gemma4.py) held to transformers
on tiny random checkpoints (tiny_models.GEMMA_VISION): an image's rows equal (fp32, 1e-5) to the
whole model's image features on the pixels transformers' processor makes, its placeholder ids
what transformers' processor expands the template's marker to, on odd image sizes; loading reads
the vision tensors alone."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

from llmcli.errors import ModelLoadError
from llmcli.models.lean_tokenizer import LeanTokenizer
from llmcli.models.tensor_file import TensorFile
from llmcli.models.vision.checkpoint_part import transformers_name
from llmcli.models.vision.gemma3 import Gemma3Vision
from llmcli.models.vision.gemma4 import Gemma4Vision

from tiny_models import GEMMA_VISION, build_tiny_model

ENCODERS: dict[str, Any] = {"gemma3_vl": Gemma3Vision, "gemma4_vl": Gemma4Vision}
VISION_PREFIXES = {
    "gemma3_vl": ("model.vision_tower.", "model.multi_modal_projector."),
    "gemma4_vl": ("model.vision_tower.", "model.embed_vision."),
}
SIZES = [(1, 1), (3000, 20), (64, 48)]  # width × height


def image_of(size: tuple[int, int]) -> Image.Image:
    generator = torch.Generator().manual_seed(size[0] * 7919 + size[1])
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


@pytest.fixture(scope="module", params=sorted(GEMMA_VISION))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / request.param, request.param)


@pytest.fixture(scope="module")
def encoder(folder: Path):
    """Built as the native path builds it: llmcli's own tokenizer, no transformers tokenizer."""
    return ENCODERS[folder.name].from_folder(folder, torch.float32, "cpu", tokenizer=LeanTokenizer(folder))


@pytest.fixture(scope="module")
def reference(folder: Path):
    import transformers

    model_class = getattr(transformers, GEMMA_VISION[folder.name]["model"])
    return model_class.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def processed(
    folder: Path, hf_tokenizer, image: Image.Image, marker: str
) -> tuple[str, list[int], dict[str, Any]]:
    """transformers' processor on the template's marker alone and the image: the text and ids it
    expands the marker to, and the inputs its model reads. Gemma 3's is Gemma3Processor itself with the
    PIL image processor; Gemma4Processor does not construct without a video processor, which
    needs torchvision, so its own replace_image_token expands the marker for the count its PIL
    image processor gives."""
    from transformers import AutoImageProcessor, Gemma3Processor, Gemma4Processor

    image_processor = AutoImageProcessor.from_pretrained(folder)
    if folder.name == "gemma3_vl":
        assert type(image_processor).__name__ == "Gemma3ImageProcessorPil"
        rows = GEMMA_VISION[folder.name]["config"]["mm_tokens_per_image"]
        processor = Gemma3Processor(image_processor, hf_tokenizer, image_seq_length=rows)
        out = processor(text=marker, images=[image], add_special_tokens=False, return_tensors="pt")
        return (
            processor.full_image_sequence,
            out["input_ids"][0].tolist(),
            {"pixel_values": out["pixel_values"]},
        )
    assert type(image_processor).__name__ == "Gemma4ImageProcessorPil"
    out = image_processor(images=[image], return_tensors="pt")
    tokens = SimpleNamespace(
        **{name: getattr(hf_tokenizer, name) for name in ("boi_token", "image_token", "eoi_token")}
    )
    text = Gemma4Processor.replace_image_token(tokens, out, 0)
    inputs = {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}
    return text, hf_tokenizer.encode(text, add_special_tokens=False), inputs


def image_features(reference, inputs: dict[str, Any]) -> torch.Tensor:
    """What the whole model scatters into its image tokens' embeddings."""
    with torch.inference_mode():
        features = reference.model.get_image_features(**inputs).pooler_output
    return torch.cat(list(features)) if isinstance(features, tuple) else features[0]


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def test_rows_and_placeholder_equal_transformers(
    folder: Path, encoder, reference, hf_tokenizer, size
) -> None:
    image = image_of(size)
    prepared = encoder.prepare(image)
    text, ids, inputs = processed(folder, hf_tokenizer, image, encoder.template_text)
    assert list(prepared.placeholder.ids) == ids
    assert encoder.placeholder_text(prepared) == text
    assert prepared.placeholder.image_token_id == reference.config.image_token_id
    for name, value in inputs.items():
        assert torch.equal(prepared.inputs[name], value), name
    rows = encoder.encode(prepared)
    expected = image_features(reference, inputs)
    assert rows.shape == (
        ids.count(reference.config.image_token_id),
        reference.config.text_config.hidden_size,
    )
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-5)


def test_gemma4_rows_follow_the_image_size(folder: Path, encoder) -> None:
    """Gemma 4 keeps an image's aspect ratio (its row count is its size's); Gemma 3 squares it."""
    placeholders = [encoder.prepare(image_of(size)).placeholder for size in SIZES]
    counts = [placeholder.ids.count(placeholder.image_token_id) for placeholder in placeholders]
    assert counts == ([64, 70, 63] if folder.name == "gemma4_vl" else [4, 4, 4])


def test_the_chat_template_writes_the_marker_for_an_image(folder: Path, encoder, hf_tokenizer) -> None:
    content = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    assert text.count(encoder.template_text) == 1
    assert encoder.template_text == GEMMA_VISION[folder.name]["tokens"][GEMMA_VISION[folder.name]["marker"]]


def test_which_layers_let_an_image_attend_both_ways(folder: Path, encoder, reference) -> None:
    text = reference.config.text_config
    assert encoder.bidirectional
    if folder.name == "gemma3_vl":  # every layer (a sliding one within its window)
        assert encoder.bidirectional_layers == tuple(range(text.num_hidden_layers))
    else:  # use_bidirectional_attention "vision": the sliding layers alone; unset: none
        assert encoder.bidirectional_layers == (0, 2, 4)
        config = copy.deepcopy(reference.config)
        config.text_config.use_bidirectional_attention = None
        causal = Gemma4Vision(config, reference.state_dict(), LeanTokenizer(folder))
        assert not causal.bidirectional and causal.bidirectional_layers == ()


def test_loading_reads_the_vision_tensors_alone(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    real_get = TensorFile.get

    def get(self: TensorFile, name: str) -> torch.Tensor:
        read.append(name)
        return real_get(self, name)

    monkeypatch.setattr(TensorFile, "get", get)
    ENCODERS[folder.name].from_folder(folder, torch.float32, "cpu", tokenizer=LeanTokenizer(folder))
    names = TensorFile(folder / "model.safetensors").keys()
    stored = [transformers_name(name) for name in names]
    vision = [name for name in stored if name.startswith(VISION_PREFIXES[folder.name])]
    assert len(stored) > len(vision) > 0
    assert sorted(transformers_name(name) for name in read) == sorted(vision)


def test_gemma3_as_google_released_it(folder: Path, encoder, tmp_path: Path) -> None:
    """Gemma 3's released files keep SigLIP's `vision_model.` level under `vision_tower.`, which
    transformers 5 drops on load: the same tensors under those names give the same rows."""
    if folder.name != "gemma3_vl":
        pytest.skip("Gemma 4 was released under transformers 5's names")
    from safetensors.torch import load_file, save_file

    released = tmp_path / "released"
    shutil.copytree(folder, released)
    tensors = load_file(folder / "model.safetensors")
    renamed = {
        name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, released / "model.safetensors", metadata={"format": "pt"})
    loaded = Gemma3Vision.from_folder(released, torch.float32, "cpu", tokenizer=LeanTokenizer(released))
    prepared = encoder.prepare(image_of((64, 48)))
    assert torch.equal(loaded.encode(prepared), encoder.encode(prepared))


def test_built_from_a_config_and_tensors_as_another_reader_gives_them(
    folder: Path, encoder, reference
) -> None:
    """The way a GGUF mmproj reader feeds it: the config object and tensors by transformers' names
    (here the reference model's own), in another dtype."""
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in reference.state_dict().items()}
    settings = encoder.processor.to_dict()
    other = ENCODERS[folder.name](
        reference.config, tensors, LeanTokenizer(folder), processor_settings=settings, dtype=torch.bfloat16
    )
    prepared = other.prepare(image_of((64, 48)))
    rows = other.encode(prepared)
    assert rows.dtype == torch.bfloat16
    assert prepared.placeholder == encoder.prepare(image_of((64, 48))).placeholder
    torch.testing.assert_close(rows.float(), encoder.encode(prepared), rtol=0.05, atol=0.05)


def test_a_processor_the_tower_cannot_honour_is_refused_in_one_line(folder: Path, reference) -> None:
    settings = {"do_pan_and_scan": True} if folder.name == "gemma3_vl" else {"patch_size": 8}
    with pytest.raises(ModelLoadError) as refused:
        ENCODERS[folder.name](
            reference.config, reference.state_dict(), LeanTokenizer(folder), processor_settings=settings
        )
    assert "\n" not in str(refused.value)


def test_importing_the_vision_modules_imports_no_transformers() -> None:
    code = (
        "import sys, llmcli.models.vision.gemma3, llmcli.models.vision.gemma4; "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
