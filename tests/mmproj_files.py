"""Tiny vision projector files written as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes
them, from tiny transformers vision towers: the names from gguf's own TensorNameMap (the
converter's map), its keys through GGUFWriter's own methods, and its cuts and shifts done the
same way (Gemma 3's soft-embedding norm + 1; Qwen's qkv cut into q/k/v, its Conv3d into two
Conv2d kernels). Shared by tests/test_mmproj.py and scripts that hand the files to llama.cpp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

MEAN, STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]


# The decoder beside each tiny tower: only its width matters to the projector.
TEXT = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
TEXT |= {"num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300}
MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e6}}


def tiny_gemma3(width: int = 64) -> Any:
    """A tiny Gemma3ForConditionalGeneration (fp32, random weights away from their init), its
    decoder `width` wide (llama.cpp checks the projector's output against its text model's)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    vision = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = Gemma3Config(
        text_config=TEXT | {"hidden_size": width},
        vision_config=vision | {"image_size": 64, "patch_size": 8, "vision_use_head": False},
        mm_tokens_per_image=4,
        boi_token_index=297,
        eoi_token_index=298,
        image_token_index=299,
    )
    model = _randomised(Gemma3ForConditionalGeneration(config))
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():  # the converter stores it in F16 whatever the file's type: made exact there
        projection.copy_(projection.half().float())
    return model


QWEN_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2}


def tiny_qwen25vl(width: int = 64) -> Any:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    vision = QWEN_TOWER | {"depth": 4, "patch_size": 14, "fullatt_block_indexes": [1, 3], "window_size": 56}
    text = TEXT | MROPE | {"hidden_size": width, "bos_token_id": 0, "eos_token_id": 1}  # (defaults: past 300)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision | {"out_hidden_size": width})
    return _randomised(Qwen2_5_VLForConditionalGeneration(config))


def tiny_qwen3vl(deepstack: tuple[int, ...] = (0, 2), width: int = 64) -> Any:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    vision = QWEN_TOWER | {"depth": 3, "patch_size": 16, "num_position_embeddings": 16}
    vision["deepstack_visual_indexes"] = list(deepstack)
    vision["out_hidden_size"] = width
    config = Qwen3VLConfig(text_config=TEXT | MROPE | {"hidden_size": width}, vision_config=vision)
    return _randomised(Qwen3VLForConditionalGeneration(config))


def _randomised(model: Any) -> Any:
    """Every weight random (norms away from 1, biases away from 0), so a tensor read into the
    wrong place or a shift left undone shows in the features."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2 + (1.0 if parameter.ndim == 1 else 0.0))
    return model.eval()


def write_mmproj(
    model: Any, path: Path, tensor_type: str = "F32", pixels: tuple[int, int] | None = None
) -> Path:
    """`model`'s vision part as llama.cpp's converter writes its mmproj file, each matrix in
    `tensor_type` (F32, F16, BF16 or Q8_0) where the converter does not force one (_stored_type);
    `pixels`: a Qwen processor's pixel budget (min, max), as the converter copies it."""
    import gguf

    config = model.config
    kind = config.model_type
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    _write_keys(writer, config)
    if pixels is not None:
        writer.add_uint32(gguf.Keys.ClipVision.IMAGE_MIN_PIXELS, pixels[0])
        writer.add_uint32(gguf.Keys.ClipVision.IMAGE_MAX_PIXELS, pixels[1])
    vision_names = {
        "gemma3": _gemma3_tensors,
        "qwen2_5_vl": _qwen25_tensors,
        "qwen3_vl": _qwen3_tensors,
        "qwen3_5": _qwen3_tensors,  # Qwen3-VL's tower without its deepstack mergers
    }
    for name, tensor in vision_names[kind](model):
        values, raw_dtype = _encoded(name, tensor, _stored_type(name, tensor.ndim, tensor_type, kind))
        writer.add_tensor(name, values, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_keys(writer: Any, config: Any) -> None:
    """The keys MmprojModel and the family's class write."""
    import gguf

    vision, kind = config.vision_config, config.model_type
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config.text_config.hidden_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_image_mean(MEAN)
    writer.add_vision_image_std(STD)
    if kind == "gemma3":
        writer.add_vision_image_size(vision.image_size)
        writer.add_vision_block_count(vision.num_hidden_layers)
        writer.add_vision_head_count(vision.num_attention_heads)
        writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
        writer.add_vision_use_gelu(True)
        pooling = (vision.image_size // vision.patch_size) // int(config.mm_tokens_per_image**0.5)
        if pooling != 4:
            writer.add_vision_projector_scale_factor(pooling)
        return
    writer.add_vision_block_count(vision.depth)
    writer.add_vision_head_count(vision.num_heads)
    writer.add_vision_attention_layernorm_eps(1e-6)
    if kind == "qwen2_5_vl":
        writer.add_vision_image_size(560)  # the converter's fixed value: Qwen sizes each image
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(vision.fullatt_block_indexes[0] + 1)
        writer.add_vision_window_size(vision.window_size)
        return
    writer.add_vision_image_size(int(vision.num_position_embeddings**0.5 * vision.patch_size))
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision.spatial_merge_size)
    deepstack = set(getattr(vision, "deepstack_visual_indexes", None) or ())  # Qwen3.5's: none
    writer.add_vision_is_deepstack_layers([index in deepstack for index in range(vision.depth)])


def _vision_state(model: Any, prefixes: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """The vision tensors as a released checkpoint names them (no `model.`)."""
    for name, tensor in model.state_dict().items():
        name = name.removeprefix("model.")
        if name.startswith(prefixes):
            yield name, tensor.detach().float()


def _mapped(name: str, block_count: int) -> str:
    mapped = _name_map(block_count).get_name(name, (".weight", ".bias"))
    assert mapped is not None, name
    return mapped


@functools.lru_cache(maxsize=4)
def _name_map(block_count: int) -> Any:
    """gguf's table of the converter's names (80 ms to build: once, not once a tensor)."""
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, block_count)


def _gemma3_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    for name, tensor in _vision_state(model, ("vision_tower.", "multi_modal_projector.")):
        # The released checkpoints keep SigLIP's vision_model level, which transformers 5 drops.
        name = name.replace("vision_tower.", "vision_tower.vision_model.").replace("_weight", ".weight")
        if "soft_emb_norm.weight" in name:
            tensor = tensor + 1  # llama.cpp's RMSNorm multiplies by the weight itself
        yield _mapped(name, 64), tensor


def _qwen_cuts(name: str, tensor: Any, cut_qkv: bool) -> Iterator[tuple[str, Any]]:
    """The converter's Conv3d → two Conv2d cut, and (Qwen2.5-VL) its qkv → q, k, v cut."""
    import gguf

    patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
    if name == "visual.patch_embed.proj.weight":
        yield patch + ".weight", tensor[:, :, 0]
        yield patch + ".weight.1", tensor[:, :, 1]
    elif cut_qkv and ".qkv." in name:
        for part, piece in zip("qkv", tensor.chunk(3), strict=True):
            yield _mapped(name.replace("qkv", part), 64), piece
    else:
        yield name, tensor


def _qwen25_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    for name, tensor in _vision_state(model, ("visual.",)):
        for cut_name, piece in _qwen_cuts(name, tensor, cut_qkv=True):
            yield (cut_name if cut_name.startswith("v.") else _mapped(cut_name, 64)), piece


def _qwen3_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    import gguf

    deepstack = getattr(model.config.vision_config, "deepstack_visual_indexes", None) or []
    layers = {"norm": "V_DS_NORM", "linear_fc1": "V_DS_FC1", "linear_fc2": "V_DS_FC2"}
    merger = {
        "norm": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_POST_NORM],
        "linear_fc1": "mm.0",
        "linear_fc2": "mm.2",
    }
    for name, tensor in _vision_state(model, ("visual.",)):
        parts = name.split(".")
        if parts[1] == "deepstack_merger_list":
            template = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[layers[parts[3]]]]
            yield template.format(bid=deepstack[int(parts[2])]) + "." + parts[4], tensor
        elif parts[1] == "merger":
            yield merger[parts[2]] + "." + parts[3], tensor
        elif name == "visual.patch_embed.proj.bias":
            yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".bias", tensor
        else:
            for cut_name, piece in _qwen_cuts(name, tensor, cut_qkv=False):
                yield (cut_name if cut_name.startswith("v.") else _mapped(cut_name, 64)), piece


def _stored_type(name: str, ndim: int, tensor_type: str, kind: str) -> str:
    """The type the converter stores a tensor in: 1-D tensors and position embeddings F32; the
    patch embedding F16 in an F16 file, else F32 (Gemma 3's always F32, as all its embeddings);
    Gemma 3's input projection F16 (clip.cpp transposes it, which a block type cannot do)."""
    if ndim == 1 or "position_embd" in name:
        return "F32"
    if ".patch_embd.weight" in name:
        return "F16" if tensor_type == "F16" and kind != "gemma3" else "F32"
    if "input_projection" in name:
        return "F16"
    return tensor_type


def _encoded(name: str, tensor: Any, tensor_type: str) -> tuple[np.ndarray, Any]:
    """The tensor in `tensor_type`, F16 where a row does not fill whole blocks (the converter's
    fallback); raw_dtype: GGUFWriter's, for blocks it cannot tell from the array's dtype."""
    import gguf

    values = tensor.contiguous().numpy().astype(np.float32)
    if tensor_type == "F32":
        return values, None
    kind = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F16" or values.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        return values.astype(np.float16), None
    quantize: Callable[..., np.ndarray] = gguf.quants.quantize
    return quantize(values, kind), kind
