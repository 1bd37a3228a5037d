"""SmolVLM's and Idefics3's vision part (models/vision/idefics3.py) held to transformers: the
rows `encode` gives equal to what the whole model scatters into its inputs_embeds at the image
tokens (fp32, an image of several tiles), and the placeholder ids equal to what transformers'
processor (with the PIL image processor) writes for `<image>` on odd sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from llmcli.models.vision.idefics3 import VISION_PREFIXES, Idefics3Vision, _vision_tensors

from tiny_models import IDEFICS3_FAMILIES, build_tiny_idefics3

SIZES = [(1, 1), (3000, 20), (64, 48)]  # (width, height): a dot, a wide strip, 2 × 2 tiles


@pytest.fixture(scope="module", params=sorted(IDEFICS3_FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("models") / request.param, request.param)


@pytest.fixture(scope="module")
def encoder(folder: Path) -> Idefics3Vision:
    return Idefics3Vision.from_folder(folder, torch.float32)


@pytest.fixture(scope="module")
def reference(folder: Path):
    import transformers

    model_class = getattr(transformers, IDEFICS3_FAMILIES[folder.name][1])
    return model_class.from_pretrained(folder, dtype=torch.float32).eval()


def noise(size: tuple[int, int], seed: int = 0) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


@pytest.mark.parametrize("size", [(64, 48), (3000, 20)])
def test_encode_equals_what_transformers_scatters_at_the_image_tokens(encoder, reference, size) -> None:
    prepared = encoder.prepare(noise(size))
    ids = torch.tensor([prepared.placeholder.ids])
    assert prepared.inputs["pixel_values"].shape[1] > 1  # several tiles
    seen: dict[str, torch.Tensor] = {}

    def keep(module, args, kwargs) -> None:
        seen["embeds"] = kwargs["inputs_embeds"]

    hook = reference.model.text_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            reference(input_ids=ids, **prepared.inputs)
    finally:
        hook.remove()
    at_images = ids[0] == prepared.placeholder.image_token_id
    expected = seen["embeds"][0][at_images]
    rows = encoder.encode(prepared)
    assert rows.shape == expected.shape and rows.dtype == torch.float32
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", SIZES)
def test_placeholder_ids_equal_transformers_processor(folder: Path, encoder, size) -> None:
    # SmolVLMProcessor needs a video processor (torchvision) and num2words; Idefics3Processor
    # expands `<image>` with the same code (get_image_prompt_string / replace_image_token), so it
    # is the reference for both, over each family's own PIL image processor.
    from transformers import AutoTokenizer, Idefics3Processor

    processor = Idefics3Processor(
        image_processor=encoder.image_processor,
        tokenizer=AutoTokenizer.from_pretrained(folder),
        image_seq_len=encoder.image_seq_len,
    )
    image = noise(size)
    expected = processor(text="<image>", images=[image], add_special_tokens=False)
    prepared = encoder.prepare(image)
    assert list(prepared.placeholder.ids) == expected["input_ids"][0]
    assert prepared.placeholder.grid is None
    torch.testing.assert_close(prepared.inputs["pixel_values"], torch.as_tensor(expected["pixel_values"]))


def test_only_the_vision_tower_and_connector_are_read(folder: Path, encoder) -> None:
    tensors = _vision_tensors(folder)
    assert tensors and all(name.startswith(VISION_PREFIXES) for name in tensors)
    loaded = len(encoder.vision_model.state_dict()) + len(encoder.connector.state_dict())
    assert len(tensors) == loaded
    modules = (encoder.vision_model, encoder.connector)
    assert not any(t.is_meta for module in modules for t in [*module.parameters(), *module.buffers()])
    assert encoder.template_text == "<image>" and encoder.bidirectional is False


def test_a_folder_without_its_image_processor_settings_is_refused_in_one_line(folder: Path, tmp_path) -> None:
    from llmcli.errors import ModelLoadError

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(folder / name)
    with pytest.raises(ModelLoadError, match=r"preprocessor_config\.json") as refused:
        Idefics3Vision.from_folder(tmp_path, torch.float32)
    assert "\n" not in refused.value.one_line()


def test_importing_it_imports_neither_torch_nor_transformers() -> None:
    """A text-only call that asks which vision part a checkpoint has pays for neither."""
    import subprocess
    import sys

    heavy = "{'torch', 'transformers'}"
    probe = f"import sys, llmcli.models.vision.idefics3; print(sorted({heavy} & {{*sys.modules}}))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
