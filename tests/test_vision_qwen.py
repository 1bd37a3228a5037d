"""Qwen's vision part (models/vision/qwen_vl.py) and multimodal RoPE (models/vision/mrope.py),
held to transformers on tiny random checkpoints of each family (Qwen3.5 dense and MoE,
Qwen2.5-VL, Qwen3-VL): an image's rows equal to the whole model's `get_image_features` in fp32, its
placeholder as Qwen's processors expand the template's marker, the prompt's [3, T] positions and
the next token's position as `get_rope_index` lays them out, and the cos/sin as the text model's
rotary embedding computes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from llmcli.errors import ModelLoadError, UsageError
from llmcli.models.lean_tokenizer import LeanTokenizer
from llmcli.models.vision.mrope import rope_cos_sin
from llmcli.models.vision.qwen_vl import TEMPLATE_TEXT, QwenVisionEncoder, read_vision_tensors

from tiny_models import VISION_FAMILIES, build_tiny_model, vision_language_model

# An ordinary image, one as long and thin as Qwen's processor takes, and a single pixel (resized
# up to the processor's least number of pixels).
SIZES = [(64, 48), (3000, 20), (1, 1)]


@pytest.fixture(scope="module", params=sorted(VISION_FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / request.param, request.param)


@pytest.fixture(scope="module")
def encoder(folder: Path) -> QwenVisionEncoder:
    return QwenVisionEncoder.from_folder(folder, torch.float32, "cpu", LeanTokenizer(folder))


@pytest.fixture(scope="module")
def reference(folder: Path):
    return vision_language_model(folder)


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("size", SIZES)
def test_rows_equal_transformers_image_features(encoder: QwenVisionEncoder, reference, size) -> None:
    prepared = encoder.prepare(noise(*size))
    rows, deepstack = encoder.encode_with_deepstack(prepared)
    with torch.no_grad():
        expected = reference.get_image_features(**prepared.inputs)
    hidden = reference.config.text_config.hidden_size
    assert rows.shape == (len(prepared.placeholder.ids) - 2, hidden)
    torch.testing.assert_close(rows, expected.pooler_output[0], rtol=0, atol=1e-5)
    # Qwen3-VL's rows for its first decoder layers: one set per deepstack block of its tower
    layers = reference.config.vision_config.to_dict().get("deepstack_visual_indexes", [])
    assert len(deepstack) == len(layers)
    for given, (wanted,) in zip(deepstack, getattr(expected, "deepstack_features", None) or [], strict=True):
        torch.testing.assert_close(given, wanted, rtol=0, atol=1e-5)
    if not layers:
        torch.testing.assert_close(encoder.encode(prepared), rows, rtol=0, atol=0)
        return
    # Without its deepstack rows Qwen3-VL's decoder would answer, wrongly: encode alone refuses.
    with pytest.raises(ModelLoadError, match="deepstack") as refused:
        encoder.encode(prepared)
    assert "\n" not in str(refused.value)


def qwen_processor(folder: Path, image_processor, tokenizer):
    """The model's own processor (Qwen2_5_VLProcessor; Qwen3VLProcessor for Qwen3.5), its image
    processor and tokenizer set as its __init__ sets them: that __init__ looks up a video
    processor, which needs torchvision."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processor_class = Qwen2_5_VLProcessor if folder.name == "qwen2_5_vl" else Qwen3VLProcessor
    processor = object.__new__(processor_class)
    processor.image_processor, processor.tokenizer = image_processor, tokenizer
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    return processor


@pytest.mark.parametrize("size", SIZES)
def test_placeholder_is_the_marker_as_the_processor_expands_it(
    encoder: QwenVisionEncoder, folder: Path, size
) -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = noise(*size)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    expected = image_processor(images=[image], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = qwen_processor(folder, image_processor, tokenizer)
    expanded = TEMPLATE_TEXT.replace(processor.image_token, processor.replace_image_token(expected, 0))

    prepared = encoder.prepare(image)
    placeholder = prepared.placeholder
    assert list(placeholder.ids) == tokenizer(expanded)["input_ids"]
    assert placeholder.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    t, h, w = expected["image_grid_thw"][0].tolist()
    assert placeholder.grid == (t, h // 2, w // 2)
    assert torch.equal(prepared.inputs["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(prepared.inputs["pixel_values"], expected["pixel_values"])


def test_an_image_the_processor_cannot_resize_is_refused_in_one_line(
    encoder: QwenVisionEncoder, folder: Path
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    too_thin = noise(3000, 14)
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLImageProcessorPil.from_pretrained(folder)(images=[too_thin])
    with pytest.raises(UsageError) as refused:
        encoder.prepare(too_thin)
    assert "3000×14" in str(refused.value) and "\n" not in str(refused.value)
    encoder.prepare(noise(2800, 14))  # a ratio of 200 is still taken


def test_only_the_vision_tensors_are_read(folder: Path, reference) -> None:
    tensors = read_vision_tensors(folder)
    assert len(tensors) == len(reference.model.visual.state_dict())
    assert all(name.startswith(("model.visual.", "visual.")) for name in tensors)


def test_importing_the_vision_modules_imports_no_transformers() -> None:
    script = (
        "import sys, llmcli.models.vision.qwen_vl, llmcli.models.vision.mrope; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


# Multimodal RoPE -----------------------------------------------------------------------------


Grid = tuple[int, int, int]


@pytest.fixture(scope="module")
def mrope_prompts(reference) -> list[tuple[list[int], list[Grid]]]:
    """Prompts of 0, 1 and 2 images of different grids (in merged patches), text between and
    after, as the template and processor lay them out; with each image's grid."""
    config = reference.config
    start, pad, end = config.vision_start_token_id, config.image_token_id, config.vision_end_token_id
    text = [7, 8, 9]

    def image(grid: Grid) -> list[int]:
        return [start, *[pad] * (grid[0] * grid[1] * grid[2]), end]

    one, two = (1, 3, 4), (1, 5, 2)
    return [
        (text + text, []),
        (text + image(one) + text, [one]),
        (text + image(one) + text + image(two) + text * 2, [one, two]),
        (image(two) + image(one), [two, one]),  # images back to back, nothing after
    ]


def transformers_rope_index(reference, ids: list[int], grids: list[Grid]):
    """get_rope_index's positions [3, T] and rope delta for one prompt, given the processor's
    image_grid_thw (patches, before merging) and mm_token_type_ids."""
    input_ids = torch.tensor([ids])
    token_types = (input_ids == reference.config.image_token_id).int()
    grid_thw = torch.tensor([[t, h * 2, w * 2] for t, h, w in grids]) if grids else None
    positions, delta = reference.model.get_rope_index(input_ids, token_types, image_grid_thw=grid_thw)
    return positions[:, 0], int(delta)


def test_cos_sin_equal_the_text_models_rotary_embedding(reference, mrope_prompts) -> None:
    rotary = reference.model.language_model.rotary_emb
    rope = reference.config.text_config.rope_parameters
    # Qwen3.5's rotary embedding interleaves whatever the config says (Qwen3-VL's too); Qwen2.5-VL's
    # takes chunks.
    interleaved = rope.get("mrope_interleaved", False)
    assert interleaved == (not isinstance(reference, _qwen2_5_vl_class()))
    for ids, grids in mrope_prompts:
        positions, _ = (
            transformers_rope_index(reference, ids, grids)
            if grids
            else (torch.arange(len(ids)).expand(3, -1), 0)
        )
        probe = torch.zeros(1, len(ids), 1)
        expected_cos, expected_sin = rotary(probe, positions[:, None])
        cos, sin = rope_cos_sin(
            positions, rotary.inv_freq, rope["mrope_section"], interleaved, rotary.attention_scaling
        )
        torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=0)


def _qwen2_5_vl_class() -> type:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


# Rotary embeddings of heads with 8 frequencies, sections as wide as the released ones' in
# proportion: the tiny checkpoints' Qwen3.5 rotates 2 (where interleaving and chunks agree).
ROTARIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding", True),
    "qwen3_vl": ("Qwen3VLTextConfig", "qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding", True),
    "qwen2_5_vl": ("Qwen2_5_VLTextConfig", "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding", False),
}


@pytest.mark.parametrize("family", sorted(ROTARIES))
def test_cos_sin_of_wider_sections_equal_transformers(family: str) -> None:
    import importlib

    import transformers

    config_name, rotary_path, interleaved = ROTARIES[family]
    module, rotary_name = rotary_path.rsplit(".", 1)
    rotary_class = getattr(importlib.import_module(f"transformers.models.{module}"), rotary_name)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
    if family == "qwen3_5":  # a quarter of each head rotated, as Qwen3.5 does
        rope["partial_rotary_factor"] = 0.25
    head_dim = 64 if family == "qwen3_5" else 16
    config = getattr(transformers, config_name)(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_parameters=rope
    )
    rotary = rotary_class(config)
    assert rotary.inv_freq.numel() == 8
    positions = torch.randint(0, 40, (3, 30), generator=torch.Generator().manual_seed(0))
    expected_cos, expected_sin = rotary(torch.zeros(1, 30, 1), positions[:, None])
    cos, sin = rope_cos_sin(positions, rotary.inv_freq, rope["mrope_section"], interleaved)
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=0)


def test_a_config_and_tensors_named_under_the_tower_build_the_same_encoder(folder: Path, encoder) -> None:
    """How a GGUF mmproj reader feeds the encoder: config.json's values, the tower's tensors by
    their names under it, the processor's settings; no folder."""
    config = json.loads((folder / "config.json").read_text())
    tensors = {name.split("visual.", 1)[1]: tensor for name, tensor in read_vision_tensors(folder).items()}
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    built = QwenVisionEncoder(config, tensors, processor_settings=settings, dtype=torch.float32)
    prepared = built.prepare(noise(64, 48))
    assert prepared.placeholder == encoder.prepare(noise(64, 48)).placeholder
    torch.testing.assert_close(
        built.encode_with_deepstack(prepared)[0], encoder.encode_with_deepstack(prepared)[0]
    )


def test_without_settings_the_processor_is_the_released_ones_for_the_towers_patches(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    built = QwenVisionEncoder(config, read_vision_tensors(folder))
    processor = built.processor
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (4, 2, 2)
    released_pixels = (3136, 12845056) if folder.name == "qwen2_5_vl" else (65536, 16777216)
    assert (processor.size.shortest_edge, processor.size.longest_edge) == released_pixels


def test_a_processor_cut_for_another_tower_is_refused_in_one_line(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    settings = json.loads((folder / "preprocessor_config.json").read_text()) | {"patch_size": 14}
    with pytest.raises(ModelLoadError, match="patch_size is 14, the vision tower's 4") as refused:
        QwenVisionEncoder(config, read_vision_tensors(folder), processor_settings=settings)
    assert "\n" not in str(refused.value)
