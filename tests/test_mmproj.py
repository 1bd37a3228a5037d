"""Vision projector files (`mmproj-*.gguf`) read back: tiny transformers towers written as
llama.cpp's converter writes them (tests/mmproj_files.py), then read by models/vision/mmproj.py
into tensors equal to the model's own and a config whose model gives the same image features."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from llmcli.errors import ModelLoadError, UsageError  # noqa: E402
from llmcli.models.vision.mmproj import find_mmproj, read_mmproj  # noqa: E402
from mmproj_files import tiny_gemma3, tiny_qwen3vl, tiny_qwen25vl, write_mmproj  # noqa: E402

FAMILIES: dict[str, Callable[[], Any]] = {
    "gemma3": tiny_gemma3,
    "qwen2.5vl_merger": tiny_qwen25vl,
    "qwen3vl_merger": tiny_qwen3vl,
}
# The one tensor the converter stores shifted (+ 1): exact only up to fp32's rounding of the shift.
SHIFTED = "model.multi_modal_projector.mm_soft_emb_norm.weight"


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest) -> Any:
    return FAMILIES[request.param]()


def _vision_state(model: Any, names: Any) -> dict[str, Any]:
    state = model.state_dict()
    return {name: state[name] for name in names}


def test_an_f32_file_gives_the_model_s_own_tensors(model: Any, tmp_path: Path) -> None:
    contents = read_mmproj(write_mmproj(model, tmp_path / "mmproj-f32.gguf"))
    own = model.state_dict()
    vision = {
        name for name in own if name.startswith(("model.visual.", "model.vision_tower.", "model.multi_"))
    }
    assert set(contents.tensors) == vision
    for name, tensor in contents.tensors.items():
        if name == SHIFTED:
            torch.testing.assert_close(tensor, own[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(tensor, own[name]), name


@pytest.mark.parametrize(("tensor_type", "bits"), [("F16", 10), ("BF16", 7)])
def test_a_half_file_gives_them_within_its_rounding(
    model: Any, tmp_path: Path, tensor_type: str, bits: int
) -> None:
    contents = read_mmproj(write_mmproj(model, tmp_path / "mmproj-half.gguf", tensor_type))
    own = _vision_state(model, contents.tensors)
    for name, tensor in contents.tensors.items():
        torch.testing.assert_close(tensor.float(), own[name], rtol=2**-bits, atol=2**-bits, msg=name)


def test_a_q8_0_file_gives_them_as_gguf_rounds_them(model: Any, tmp_path: Path) -> None:
    """Each tensor as gguf's own Q8_0 round trip gives it, or as stored where the converter
    keeps it in F32 or F16 (mmproj_files._stored_type)."""
    import gguf
    import numpy as np

    contents = read_mmproj(write_mmproj(model, tmp_path / "mmproj-q8_0.gguf", "Q8_0"))
    own = _vision_state(model, contents.tensors)
    q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = 0
    for name, tensor in contents.tensors.items():
        values = own[name].numpy()
        ways = {"F32": values, "F16": values.astype(np.float16).astype(np.float32)}
        if values.shape[-1] % 32 == 0:
            ways["Q8_0"] = gguf.quants.dequantize(gguf.quants.quantize(values, q8), q8).reshape(values.shape)
        same = [
            way
            for way, expected in ways.items()
            if np.allclose(tensor.float().numpy(), expected, rtol=0, atol=1e-6)
        ]
        assert same, name
        rounded += same == ["Q8_0"]
    assert rounded > len(contents.tensors) // 4


def test_the_model_built_from_the_file_sees_an_image_as_the_original(model: Any, tmp_path: Path) -> None:
    contents = read_mmproj(write_mmproj(model, tmp_path / "mmproj.gguf"))
    config = contents.model_config(model.config.text_config)
    assert config.architectures == [type(model).__name__]
    rebuilt = type(model)(config).eval()
    missing, unexpected = rebuilt.load_state_dict(contents.tensors, strict=False)
    assert not unexpected and not [name for name in missing if name in contents.tensors]
    inputs = _pixels(model.config)
    with torch.no_grad():
        expected = _features(model.model.get_image_features(**inputs))
        got = _features(rebuilt.model.get_image_features(**inputs))
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def _pixels(config: Any) -> dict[str, Any]:
    """A random pixel batch as each family's processor hands it to the model."""
    torch.manual_seed(1)
    vision = config.vision_config
    if config.model_type == "gemma3":
        return {"pixel_values": torch.randn(2, 3, vision.image_size, vision.image_size)}
    grid = torch.tensor([[1, 8, 12]])  # 8 × 12 patches: several of Qwen2.5-VL's windows
    width = 3 * vision.temporal_patch_size * vision.patch_size**2
    return {"pixel_values": torch.randn(int(grid.prod()), width), "image_grid_thw": grid}


def _features(output: Any) -> list[Any]:
    """Every tensor get_image_features gives (Qwen3-VL's deepstack rows too)."""
    found = []
    values = output.values() if hasattr(output, "values") else output
    for value in values:
        if torch.is_tensor(value):
            found.append(value)
        elif isinstance(value, list | tuple):
            found += _features(value)
    return found


def test_the_config_holds_the_file_s_settings(tmp_path: Path) -> None:
    gemma = read_mmproj(write_mmproj(tiny_gemma3(), tmp_path / "gemma.gguf"))
    assert gemma.mm_tokens_per_image == 4  # 8 × 8 patches pooled 4 × 4: the scale factor key
    assert gemma.processor_settings["size"] == {"height": 64, "width": 64}
    assert gemma.vision_config.layer_norm_eps == pytest.approx(1e-6)
    qwen = read_mmproj(write_mmproj(tiny_qwen25vl(), tmp_path / "qwen.gguf"))
    assert qwen.vision_config.fullatt_block_indexes == [1, 3]
    assert qwen.vision_config.window_size == 56
    assert qwen.processor_settings | {"image_mean": None} == {
        "image_mean": None,
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    qwen3 = read_mmproj(write_mmproj(tiny_qwen3vl(), tmp_path / "qwen3.gguf"))
    assert qwen3.vision_config.deepstack_visual_indexes == [0, 2]


def test_a_qwen3_projector_without_deepstack_is_qwen3_5_s_tower(tmp_path: Path) -> None:
    """Qwen3.5 shares Qwen3-VL's projector type, without the deepstack mergers."""
    from transformers import AutoModel

    model = tiny_qwen3vl(deepstack=())
    contents = read_mmproj(write_mmproj(model, tmp_path / "mmproj.gguf"))
    assert contents.architecture == "Qwen3_5ForConditionalGeneration"
    tower = AutoModel.from_config(contents.vision_config).eval()
    tower.load_state_dict({name.removeprefix("model.visual."): t for name, t in contents.tensors.items()})
    inputs = _pixels(model.config)
    with torch.no_grad():
        ours = tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        theirs = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_a_moe_decoder_takes_its_dense_twin_s_tower(tmp_path: Path) -> None:
    """Qwen3.5's MoE models share the dense ones' projector type: the decoder decides which."""
    from transformers import AutoConfig

    contents = read_mmproj(write_mmproj(tiny_qwen3vl(deepstack=()), tmp_path / "mmproj.gguf"))
    text = AutoConfig.for_model("qwen3_5_moe_text", hidden_size=64, num_experts=4, num_experts_per_tok=2)
    config = contents.model_config(text)
    assert config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert config.vision_config.depth == 3 and config.vision_config.out_hidden_size == 64


def test_a_decoder_of_another_width_is_refused(tmp_path: Path) -> None:
    contents = read_mmproj(write_mmproj(tiny_gemma3(), tmp_path / "mmproj.gguf"))
    text = contents.model_config(tiny_gemma3().config.text_config).text_config
    text.hidden_size = 128
    with pytest.raises(ModelLoadError, match="projects images to width 64, the language model's is 128"):
        contents.model_config(text)


# --- files that are not a projector llmcli reads: one line each, naming the file ---


def _clip_keys_only(path: Path, **keys: Any) -> Path:
    """A GGUF file holding only metadata: what the checks before any tensor read look at."""
    import gguf

    writer = gguf.GGUFWriter(path, keys.pop("architecture", "clip"))
    for key, value in keys.items():
        if isinstance(value, bool):
            writer.add_bool(key.replace("__", "."), value)
        else:
            writer.add_string(key.replace("__", "."), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _not_gguf(path: Path) -> Path:
    path.write_bytes(b"PNG\x89 certainly not a GGUF file" * 10)
    return path


BAD_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "not a GGUF": (_not_gguf, "is not a GGUF file"),
    "a language model": (
        lambda path: _clip_keys_only(path, architecture="llama"),
        r"is not a vision projector \(mmproj\) file: its general.architecture is llama, a llama language",
    ),
    "an audio projector": (
        lambda path: _clip_keys_only(path, clip__has_audio_encoder=True, clip__projector_type="ultravox"),
        "holds no vision encoder",
    ),
    "an unknown projector": (
        lambda path: _clip_keys_only(path, clip__has_vision_encoder=True, clip__projector_type="pixtral"),
        "is a pixtral vision projector; llmcli reads gemma3, qwen2.5vl_merger, qwen3vl_merger",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_file_that_is_no_known_projector_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    make, message = BAD_FILES[case]
    path = make(tmp_path / "mmproj-bad.gguf")
    with pytest.raises(ModelLoadError, match=message) as raised:
        read_mmproj(path)
    assert str(path) in raised.value.one_line() and "\n" not in raised.value.one_line()


def test_a_missing_tensor_is_named_by_its_gguf_name(tmp_path: Path) -> None:
    import gguf

    full = write_mmproj(tiny_qwen25vl(), tmp_path / "full.gguf")
    reader = gguf.GGUFReader(full)
    writer = gguf.GGUFWriter(tmp_path / "mmproj-cut.gguf", "clip")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for tensor in reader.tensors:
        if tensor.name != "v.blk.2.attn_k.bias":
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"mmproj-cut.gguf has no tensor v.blk.2.attn_k.bias"):
        read_mmproj(tmp_path / "mmproj-cut.gguf")


# --- finding the projector beside a model ---


def test_the_projector_beside_a_gguf_model_is_found(tmp_path: Path) -> None:
    model = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    assert find_mmproj(model) is None
    projector = tmp_path / "mmproj-gemma-3-4b-it-f16.gguf"
    projector.write_bytes(b"GGUF")
    assert find_mmproj(model) == projector


def test_several_projectors_are_listed_and_the_flag_named(tmp_path: Path) -> None:
    model = tmp_path / "Qwen2.5-VL-3B-Instruct-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    for name in ("mmproj-F16.gguf", "mmproj-F32.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(UsageError) as raised:
        find_mmproj(model)
    line = raised.value.one_line()
    assert "mmproj-F16.gguf" in line and "mmproj-F32.gguf" in line and "--mmproj FILE" in line


def test_ollama_s_projector_layer_is_found_through_its_manifest(tmp_path: Path) -> None:
    blobs = tmp_path / "models" / "blobs"
    blobs.mkdir(parents=True)
    model, projector, other = (blobs / f"sha256-{digit * 64}" for digit in "abc")
    for blob in (model, projector, other):
        blob.write_bytes(b"GGUF")
    manifest = tmp_path / "models" / "manifests" / "registry.ollama.ai" / "library" / "gemma3" / "4b"
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "a" * 64},
        {"mediaType": "application/vnd.ollama.image.projector", "digest": "sha256:" + "b" * 64},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "c" * 64},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    assert find_mmproj(model) == projector
    assert find_mmproj(other) is None  # no manifest names it as its model


# --- what the file gives feeds the family encoders (gemma3.py, qwen_vl.py) ---


def _family_encoder(contents: Any, model: Any) -> Any:
    """The family's VisionEncoder built from the file's config, tensors and processor settings,
    as from a checkpoint folder's (on a branch without the family modules: skipped)."""
    from tiny_models import train_tokenizer

    if contents.projector_type == "gemma3":
        gemma3 = pytest.importorskip("llmcli.models.vision.gemma3")
        marks = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
        tokenizer = train_tokenizer(special=marks)
        boi, eoi, image = tokenizer.convert_tokens_to_ids(list(marks))
        config = contents.model_config(
            model.config.text_config, boi_token_index=boi, eoi_token_index=eoi, image_token_index=image
        )
        return gemma3.Gemma3Vision(
            config, contents.tensors, tokenizer, processor_settings=contents.processor_settings
        )
    qwen_vl = pytest.importorskip("llmcli.models.vision.qwen_vl")
    config = contents.model_config(model.config.text_config)
    return qwen_vl.QwenVisionEncoder(config, contents.tensors, processor_settings=contents.processor_settings)


@pytest.mark.parametrize("family", ["gemma3", "qwen2.5vl_merger"])
def test_the_file_feeds_the_family_encoder_as_a_checkpoint_does(family: str, tmp_path: Path) -> None:
    from PIL import Image

    model = FAMILIES[family]()
    contents = read_mmproj(write_mmproj(model, tmp_path / "mmproj.gguf"))
    encoder = _family_encoder(contents, model)
    prepared = encoder.prepare(Image.new("RGB", (50, 70), (10, 200, 30)))
    rows = encoder.encode(prepared)
    with torch.no_grad():
        expected = model.model.get_image_features(**prepared.inputs).pooler_output
    expected = torch.cat(expected) if isinstance(expected, list | tuple) else expected
    torch.testing.assert_close(rows.reshape(expected.shape), expected, rtol=0, atol=1e-5)
