"""How llama.cpp's converter (`convert_hf_to_gguf.py --mmproj`) lays out each vision projector
llmcli reads, written as the way back: its GGUF tensor names (gguf's own TENSOR_NAMES, so a
rename there is one here) to transformers' names, and the parts it cut apart to join again.

What the converter changed on the way out, and is undone here:
  * Gemma 3: `mm_soft_emb_norm` is stored as transformers' weight + 1 (llama.cpp's RMSNorm
    multiplies by its weight, Gemma3RMSNorm by 1 + weight); `mm_input_projection_weight`, a bare
    parameter, is stored as `mm.input_projection.weight`, untransposed.
  * Qwen2.5-VL: each block's fused `attn.qkv` is cut into `attn_q`, `attn_k`, `attn_v`; the patch
    embedding's Conv3d over two frames into two Conv2d kernels, `v.patch_embd.weight` (frame 0)
    and `v.patch_embd.weight.1` (frame 1).
  * Qwen3-VL / Qwen3.5: the same Conv3d cut (qkv stays fused); the deepstack mergers are numbered
    by the tower block they read (`v.deepstack.8.…`), transformers' by their place in the list.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Suffixes a GGUF tensor name ends with; `.weight.1` is the second frame of a cut Conv3d.
SUFFIXES = (".weight.1", ".weight", ".bias")
PATCH_EMBEDDING = "v.patch_embd"


@dataclass(frozen=True)
class ProjectorLayout:
    projector_type: str  # clip.projector_type as gguf's VisionProjectorType spells it
    # transformers' name of the GGUF tensor base (without its .weight/.bias), `{bid}` a block
    # number; keyed by the gguf constant so the GGUF side is gguf's own spelling.
    names: dict[str, str]
    # Renames where transformers' parameter is not `<module>.weight`.
    exceptions: dict[str, str] = field(default_factory=dict)
    # Value changes the converter made, undone: transformers' name → the inverse.
    values: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # Whether blocks' q/k/v (and the patch embedding's two frames) are to be joined.
    joins_qkv: bool = False
    joins_frames: bool = False


def _names(pairs: dict[str, str]) -> dict[str, str]:
    """The layout's table keyed by GGUF name templates, read from gguf's TENSOR_NAMES."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    return {TENSOR_NAMES[MODEL_TENSOR[key]]: hf for key, hf in pairs.items()}


def _plus_one_undone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor - 1


# transformers 5's names: the released checkpoints' `vision_tower.vision_model.` level is gone.
GEMMA3_TOWER = "model.vision_tower."
GEMMA3_PROJECTOR = "model.multi_modal_projector."
QWEN_TOWER = "model.visual."


def gemma3_layout() -> ProjectorLayout:
    tower, layer = GEMMA3_TOWER, GEMMA3_TOWER + "encoder.layers.{bid}."
    names = {
        "V_ENC_EMBD_PATCH": tower + "embeddings.patch_embedding",
        "V_ENC_EMBD_POS": tower + "embeddings.position_embedding",
        "V_ENC_ATTN_Q": layer + "self_attn.q_proj",
        "V_ENC_ATTN_K": layer + "self_attn.k_proj",
        "V_ENC_ATTN_V": layer + "self_attn.v_proj",
        "V_ENC_ATTN_O": layer + "self_attn.out_proj",
        "V_ENC_INPUT_NORM": layer + "layer_norm1",
        "V_ENC_POST_ATTN_NORM": layer + "layer_norm2",
        "V_ENC_FFN_UP": layer + "mlp.fc1",
        "V_ENC_FFN_DOWN": layer + "mlp.fc2",
        "V_POST_NORM": tower + "post_layernorm",
        "V_MM_INP_PROJ": GEMMA3_PROJECTOR + "mm_input_projection",
        "V_MM_SOFT_EMB_NORM": GEMMA3_PROJECTOR + "mm_soft_emb_norm",
    }
    projection = GEMMA3_PROJECTOR + "mm_input_projection"
    return ProjectorLayout(
        "gemma3",
        _names(names),
        exceptions={projection + ".weight": projection + "_weight"},
        values={GEMMA3_PROJECTOR + "mm_soft_emb_norm.weight": _plus_one_undone},
    )


def _qwen_block_names(mlp: dict[str, str]) -> dict[str, str]:
    block = QWEN_TOWER + "blocks.{bid}."
    return {
        "V_ENC_EMBD_PATCH": QWEN_TOWER + "patch_embed.proj",
        "V_ENC_ATTN_QKV": block + "attn.qkv",
        "V_ENC_ATTN_O": block + "attn.proj",
        "V_ENC_INPUT_NORM": block + "norm1",
        "V_ENC_POST_ATTN_NORM": block + "norm2",
        **{key: block + "mlp." + name for key, name in mlp.items()},
    }


def qwen25vl_layout() -> ProjectorLayout:
    names = _qwen_block_names(
        {"V_ENC_FFN_GATE": "gate_proj", "V_ENC_FFN_UP": "up_proj", "V_ENC_FFN_DOWN": "down_proj"}
    )
    names |= {"V_POST_NORM": QWEN_TOWER + "merger.ln_q", "V_MMPROJ": QWEN_TOWER + "merger.mlp.{bid}"}
    return ProjectorLayout("qwen2.5vl_merger", _names(names), joins_qkv=True, joins_frames=True)


def qwen3vl_layout() -> ProjectorLayout:
    names = _qwen_block_names({"V_ENC_FFN_UP": "linear_fc1", "V_ENC_FFN_DOWN": "linear_fc2"})
    deepstack = QWEN_TOWER + "deepstack_merger_list.{bid}."
    names |= {
        "V_ENC_EMBD_POS": QWEN_TOWER + "pos_embed",
        "V_POST_NORM": QWEN_TOWER + "merger.norm",
        "V_DS_NORM": deepstack + "norm",
        "V_DS_FC1": deepstack + "linear_fc1",
        "V_DS_FC2": deepstack + "linear_fc2",
    }
    table = _names(names)
    # The merger's two layers are mm.0 and mm.2 (Qwen2-VL's Sequential places, kept by the
    # converter), transformers' linear_fc1 and linear_fc2.
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    merger = TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ]
    table |= {merger.format(bid=0): QWEN_TOWER + "merger.linear_fc1"}
    table |= {merger.format(bid=2): QWEN_TOWER + "merger.linear_fc2"}
    return ProjectorLayout("qwen3vl_merger", table, joins_qkv=True, joins_frames=True)


LAYOUTS: dict[str, Callable[[], ProjectorLayout]] = {
    "gemma3": gemma3_layout,
    "qwen2.5vl_merger": qwen25vl_layout,
    "qwen3vl_merger": qwen3vl_layout,
}


def split_suffix(name: str) -> tuple[str, str]:
    """`v.blk.0.attn_q.weight` → (`v.blk.0.attn_q`, `.weight`); no known suffix: (name, "")."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return name, ""


def join_cut_parts(tensors: dict[str, torch.Tensor], layout: ProjectorLayout) -> list[str]:
    """Join in place what the converter cut: q/k/v back into qkv (rows, in that order), the two
    frames of the patch embedding back into one Conv3d kernel (its time axis, 2). Returns the
    parts missing beside a present sibling (nothing joined there)."""
    import torch

    missing = []
    frames = [PATCH_EMBEDDING + ".weight", PATCH_EMBEDDING + ".weight.1"]
    if layout.joins_frames and frames[0] in tensors:
        if frames[1] in tensors:
            tensors[frames[0]] = torch.stack([tensors[frames[0]], tensors.pop(frames[1])], dim=2)
        elif tensors[frames[0]].ndim == 4:  # one 2-D kernel: the second frame's is missing
            missing.append(frames[1])
    if not layout.joins_qkv:
        return missing
    cut = [name for name in tensors if re.fullmatch(r"v\.blk\.\d+\.attn_[qkv]\.(weight|bias)", name)]
    for name in sorted({re.sub(r"\.attn_[qkv]\.", ".attn_{}.", name) for name in cut}):
        parts = [name.format(part) for part in "qkv"]
        absent = [part for part in parts if part not in tensors]
        if absent:
            missing += absent
            continue
        tensors[name.format("qkv")] = torch.cat([tensors.pop(part) for part in parts])
    return missing


def hf_name(gguf_name: str, layout: ProjectorLayout, renumber: Callable[[str, int], int]) -> str | None:
    """transformers' name of a GGUF tensor (None: the layout has none); `renumber` maps a block
    number in a deepstack name to the merger's place in its list."""
    base, suffix = split_suffix(gguf_name)
    for template, target in layout.names.items():
        pattern = re.escape(template).replace(re.escape("{bid}"), r"(\d+)")
        found = re.fullmatch(pattern, base)
        if found is None:
            continue
        name = target
        if found.groups():
            name = target.format(bid=renumber(template, int(found.group(1))))
        full = name + suffix
        return layout.exceptions.get(full, full)
    return None


def gguf_name(hf: str, layout: ProjectorLayout, renumber_back: Callable[[str, int], int]) -> str:
    """The GGUF name llama.cpp gives transformers' tensor `hf` (for naming what a file lacks)."""
    hf = {value: key for key, value in layout.exceptions.items()}.get(hf, hf)
    base, suffix = split_suffix(hf)
    for template, target in layout.names.items():
        pattern = re.escape(target).replace(re.escape("{bid}"), r"(\d+)")
        found = re.fullmatch(pattern, base)
        if found is not None:
            bid = renumber_back(template, int(found.group(1))) if found.groups() else None
            return template.format(bid=bid) + suffix
    return hf
