"""A vision projector file (`mmproj-*.gguf`), as llama.cpp's `convert_hf_to_gguf.py --mmproj`
writes it and llama-server `--mmproj` and ollama read it, read back into what the family vision
modules (gemma3.py, qwen_vl.py) are built from: transformers' vision config and the tower's and
projector's tensors by transformers' names, as a safetensors checkpoint would hold them.

Read: Gemma 3 (`clip.projector_type` "gemma3"), Qwen2.5-VL ("qwen2.5vl_merger") and Qwen3-VL /
Qwen3.5 ("qwen3vl_merger"); the names and cuts are in mmproj_layout.py. Every other file (not a
GGUF, a language model's GGUF, an audio-only or unknown projector, a tensor missing or of the
wrong shape) is refused in one line naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from llmcli.errors import ModelLoadError, UsageError
from llmcli.models.vision.mmproj_layout import (
    LAYOUTS,
    ProjectorLayout,
    gguf_name,
    hf_name,
    join_cut_parts,
)

if TYPE_CHECKING:
    import torch

    from llmcli.models.gguf_table import GGUFTable

CLIP_ARCHITECTURE = "clip"  # gguf's MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ]
# Gemma 3's projector pools the tower's patches 4 × 4 unless the file says otherwise
# (clip.vision.projector.scale_factor, written only when it differs).
GEMMA3_POOLING = 4
# Qwen2.5-VL's window attention span in pixels, transformers' default, when the file names none.
QWEN25_WINDOW = 112
QWEN_MERGE = 2  # clip.cpp's spatial merge where the file names none


@dataclass(frozen=True)
class MmprojContents:
    path: Path
    projector_type: str
    # The ForConditionalGeneration class whose vision part this is (Qwen3.5's for a
    # "qwen3vl_merger" without deepstack mergers: the two share the projector type).
    architecture: str
    vision_config: Any  # SiglipVisionConfig, Qwen2_5_VLVisionConfig, Qwen3VLVisionConfig, …
    # By transformers 5's names in the whole model (model.vision_tower.…,
    # model.multi_modal_projector.…, model.visual.…); floats as stored, quantized ones in fp32.
    tensors: dict[str, torch.Tensor]
    projection_dim: int  # the decoder's hidden size the projector writes
    # The image processor's settings the file holds (mean, std, sizes), in transformers' names.
    processor_settings: dict[str, Any]
    mm_tokens_per_image: int | None = None  # Gemma 3: rows per image

    def model_config(self, text_config: Any, **settings: Any) -> Any:
        """The whole model's transformers config: this tower beside the decoder's `text_config`
        (from the text GGUF), `settings` (token ids, …) passed on."""
        from transformers import AutoConfig

        hidden = getattr(text_config, "hidden_size", None)
        if hidden != self.projection_dim:
            raise ModelLoadError(
                f"{self.path} projects images to width {self.projection_dim}, "
                f"the language model's is {hidden}",
                "pass the mmproj file made with this model",
            )
        if self.mm_tokens_per_image is not None:
            settings.setdefault("mm_tokens_per_image", self.mm_tokens_per_image)
        # A MoE decoder shares its dense twin's tower and projector type: the decoder decides.
        twin = (self.architecture, getattr(text_config, "model_type", None))
        architecture = _MOE_TWINS.get(twin, self.architecture)
        vision = self.vision_config.to_dict()
        return AutoConfig.for_model(
            _MODEL_TYPES[architecture],
            text_config=text_config,
            vision_config=vision,
            architectures=[architecture],
            **settings,
        )


_MODEL_TYPES = {
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
_MOE_TWINS = {
    ("Qwen3VLForConditionalGeneration", "qwen3_vl_moe_text"): "Qwen3VLMoeForConditionalGeneration",
    ("Qwen3_5ForConditionalGeneration", "qwen3_5_moe_text"): "Qwen3_5MoeForConditionalGeneration",
}


def read_mmproj(path: Path) -> MmprojContents:
    """The projector file's tower: config, tensors and processor settings; ModelLoadError naming
    the file and what is wrong with it otherwise."""
    from llmcli.models.gguf_table import read_table

    table = read_table(Path(path))
    projector = _check_kind(table)
    layout = LAYOUTS[projector]()
    meta = _VisionKeys(table)
    tower = _CONFIGS[projector](meta, table)
    deepstack = list(getattr(tower.config, "deepstack_visual_indexes", None) or [])
    tensors = _renamed_tensors(table, layout, deepstack)
    _check_against_module(table, layout, deepstack, tensors, tower)
    settings = {"image_mean": meta.floats("image_mean"), "image_std": meta.floats("image_std")}
    return MmprojContents(
        path=table.path,
        projector_type=projector,
        architecture=tower.architecture,
        vision_config=tower.config,
        tensors=tensors,
        projection_dim=meta.whole("projection_dim"),
        processor_settings=settings | tower.processor,
        mm_tokens_per_image=tower.rows,
    )


def projector_architecture(path: Path, text_config: Any) -> str:
    """The ForConditionalGeneration class a projector file's tower belongs to beside this decoder
    (from its header alone: no tensor read); ModelLoadError naming the file where it is not a
    projector llmcli reads."""
    from llmcli.models.gguf_table import read_table

    table = read_table(Path(path))
    tower = _CONFIGS[_check_kind(table)](_VisionKeys(table), table)
    return _MOE_TWINS.get((tower.architecture, getattr(text_config, "model_type", None)), tower.architecture)


class _Tower(NamedTuple):
    """What a projector type's keys give: the tower's config, whose it is, the processor's
    settings beyond mean and std, and (Gemma 3) the rows an image becomes."""

    config: Any
    architecture: str
    processor: dict[str, Any]
    rows: int | None = None


def _check_kind(table: GGUFTable) -> str:
    """The file's projector type, once it is known to be a vision projector llmcli reads."""
    architecture = table.architecture
    if architecture != CLIP_ARCHITECTURE:
        what = f"a {architecture} language model" if architecture else "no model llama.cpp names"
        raise ModelLoadError(
            f"{table.path} is not a vision projector (mmproj) file: its general.architecture is "
            f"{architecture or 'missing'}, {what}",
            "pass the mmproj-*.gguf file that came with the model",
        )
    if not table.metadata.get("clip.has_vision_encoder"):
        raise ModelLoadError(f"{table.path} holds no vision encoder (an audio-only projector?)")
    projector = table.metadata.get("clip.vision.projector_type") or table.metadata.get("clip.projector_type")
    if projector not in LAYOUTS:
        raise ModelLoadError(
            f"{table.path} is a {projector or 'unnamed'} vision projector; llmcli reads {', '.join(LAYOUTS)}"
        )
    return str(projector)


class _VisionKeys:
    """The file's `clip.vision.*` values, each missing one named in one line."""

    def __init__(self, table: GGUFTable) -> None:
        self.table = table

    def get(self, key: str, default: Any = None) -> Any:
        return self.table.metadata.get(f"clip.vision.{key}", default)

    def whole(self, key: str) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{self.table.path} has no valid clip.vision.{key} (found {value!r})")
        return value

    def floats(self, key: str) -> list[float]:
        value = self.get(key)
        if not isinstance(value, list) or len(value) != 3:
            raise ModelLoadError(
                f"{self.table.path} has no clip.vision.{key} of three channels (found {value!r})"
            )
        return [float(channel) for channel in value]

    def tower(self) -> dict[str, Any]:
        """What every tower's config needs, in the Qwen configs' names."""
        return {
            "hidden_size": self.whole("embedding_length"),
            "intermediate_size": self.whole("feed_forward_length"),
            "depth": self.whole("block_count"),
            "num_heads": self.whole("attention.head_count"),
            "patch_size": self.whole("patch_size"),
        }


def _gemma3_config(meta: _VisionKeys, table: GGUFTable) -> _Tower:
    from transformers import SiglipVisionConfig

    tower = meta.tower()
    side = meta.whole("image_size")
    config = SiglipVisionConfig(
        hidden_size=tower["hidden_size"],
        intermediate_size=tower["intermediate_size"],
        num_hidden_layers=tower["depth"],
        num_attention_heads=tower["num_heads"],
        image_size=side,
        patch_size=tower["patch_size"],
        layer_norm_eps=float(meta.get("attention.layer_norm_epsilon", 1e-6)),
        vision_use_head=False,  # Gemma 3's tower has no pooling head
    )
    tokens_per_side = side // tower["patch_size"] // meta.get("projector.scale_factor", GEMMA3_POOLING)
    rows = tokens_per_side**2
    processor = {"size": {"height": side, "width": side}, "image_seq_length": rows}
    return _Tower(config, "Gemma3ForConditionalGeneration", processor, rows)


def _qwen_common(meta: _VisionKeys) -> dict[str, Any]:
    return meta.tower() | {
        "out_hidden_size": meta.whole("projection_dim"),
        "spatial_merge_size": meta.get("spatial_merge_size", QWEN_MERGE),
        "temporal_patch_size": 2,  # the converter cuts only two-frame kernels
    }


def _qwen_processor(meta: _VisionKeys, settings: dict[str, Any]) -> dict[str, Any]:
    processor = {
        "patch_size": settings["patch_size"],
        "temporal_patch_size": settings["temporal_patch_size"],
        "merge_size": settings["spatial_merge_size"],
    }
    least, most = meta.get("image_min_pixels"), meta.get("image_max_pixels")
    if least and most:  # the pixel budget the converter copied from the processor, where it did
        processor["size"] = {"shortest_edge": least, "longest_edge": most}
    return processor


def _qwen25vl_config(meta: _VisionKeys, table: GGUFTable) -> _Tower:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    settings = _qwen_common(meta)
    # clip.cpp's rule: every n_wa_pattern-th block attends over the whole image, the rest within
    # windows; transformers lists the whole-image blocks.
    pattern = meta.whole("n_wa_pattern")
    full = [index for index in range(settings["depth"]) if (index + 1) % pattern == 0]
    config = Qwen2_5_VLVisionConfig(
        **settings,
        hidden_act="silu",
        window_size=meta.get("window_size", QWEN25_WINDOW),
        fullatt_block_indexes=full,
    )
    return _Tower(config, "Qwen2_5_VLForConditionalGeneration", _qwen_processor(meta, settings))


def _qwen3vl_config(meta: _VisionKeys, table: GGUFTable) -> _Tower:
    settings = _qwen_common(meta)
    positions = table.tensors.get("v.position_embd.weight")
    if positions is None:
        raise ModelLoadError(f"{table.path} has no tensor v.position_embd.weight")
    settings["num_position_embeddings"] = positions.shape[0]
    deepstack = [index for index, flag in enumerate(meta.get("is_deepstack_layers") or []) if flag]
    if deepstack:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

        config = Qwen3VLVisionConfig(**settings, deepstack_visual_indexes=deepstack)
        return _Tower(config, "Qwen3VLForConditionalGeneration", _qwen_processor(meta, settings))
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    return _Tower(
        Qwen3_5VisionConfig(**settings), "Qwen3_5ForConditionalGeneration", _qwen_processor(meta, settings)
    )


_CONFIGS = {"gemma3": _gemma3_config, "qwen2.5vl_merger": _qwen25vl_config, "qwen3vl_merger": _qwen3vl_config}


def _renumberers(deepstack: list[int]) -> tuple[Any, Any]:
    """Block numbers in deepstack names: the tower block's (GGUF) ↔ the merger's place (transformers)."""

    def forward(template: str, number: int) -> int:
        return (
            deepstack.index(number) if template.startswith("v.deepstack.") and number in deepstack else number
        )

    def back(template: str, number: int) -> int:
        return (
            deepstack[number] if template.startswith("v.deepstack.") and number < len(deepstack) else number
        )

    return forward, back


def _renamed_tensors(
    table: GGUFTable, layout: ProjectorLayout, deepstack: list[int]
) -> dict[str, torch.Tensor]:
    from llmcli.models.gguf_direct import _values, read_table_bytes

    stored = {name: _values(read_table_bytes(table, entry), entry) for name, entry in table.tensors.items()}
    missing = join_cut_parts(stored, layout)
    if missing:
        raise ModelLoadError(
            f"{table.path} has no tensor {missing[0]}",
            "the file is incomplete or was written by another converter",
        )
    forward, _ = _renumberers(deepstack)
    renamed = {}
    for name, tensor in stored.items():
        target = hf_name(name, layout, forward)
        if target is None:
            raise ModelLoadError(
                f"{table.path} has a tensor {name} that a {layout.projector_type} projector does not have"
            )
        undo = layout.values.get(target)
        renamed[target] = undo(tensor) if undo else tensor
    return renamed


def _check_against_module(
    table: GGUFTable,
    layout: ProjectorLayout,
    deepstack: list[int],
    tensors: Mapping[str, torch.Tensor],
    tower: _Tower,
) -> None:
    """Every tensor transformers' tower (and projector) has, of its shape: built on the meta
    device from the config, so the check is the module's own list, at no memory cost."""
    expected = _expected_shapes(tower.architecture, tower.config, tensors)
    _, back = _renumberers(deepstack)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelLoadError(
                f"{table.path} has no tensor {gguf_name(name, layout, back)} (transformers' {name})",
                "the file is incomplete or was written by another converter",
            )
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(
                f"{table.path}: tensor {gguf_name(name, layout, back)} is {list(tensors[name].shape)}, "
                f"its clip.vision settings make it {list(shape)}"
            )
    unknown = sorted(tensors.keys() - expected.keys())
    if unknown:
        raise ModelLoadError(
            f"{table.path} has a tensor {gguf_name(unknown[0], layout, back)} the tower does not have"
        )


def _expected_shapes(
    architecture: str, vision_config: Any, tensors: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoModel

    from llmcli.models.vision.mmproj_layout import GEMMA3_PROJECTOR, GEMMA3_TOWER, QWEN_TOWER

    with torch.device("meta"):
        tower = AutoModel.from_config(vision_config)
        prefix = QWEN_TOWER
        shapes: dict[str, tuple[int, ...]] = {}
        if architecture == "Gemma3ForConditionalGeneration":
            from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

            prefix = GEMMA3_TOWER
            # The projector's output width is the decoder's: the file's projection_dim, checked
            # against the text model's by MmprojContents.model_config.
            width = tensors.get(GEMMA3_PROJECTOR + "mm_input_projection_weight")
            text = {"hidden_size": width.shape[1] if width is not None else 1}
            projector = Gemma3MultiModalProjector(_gemma3_whole(vision_config, text))
            shapes |= {GEMMA3_PROJECTOR + name: tuple(p.shape) for name, p in projector.state_dict().items()}
    return {prefix + name: tuple(p.shape) for name, p in tower.state_dict().items()} | shapes


def _gemma3_whole(vision_config: Any, text: dict[str, Any]) -> Any:
    from transformers import Gemma3Config

    tokens = (vision_config.image_size // vision_config.patch_size // GEMMA3_POOLING) ** 2
    return Gemma3Config(vision_config=vision_config, text_config=text, mm_tokens_per_image=max(tokens, 1))


# Where ollama keeps each model's layers, and the media types of the two that matter here.
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"


def find_mmproj(model_path: Path) -> Path | None:
    """The projector file beside a GGUF model, the way llama.cpp's and LM Studio's downloads lay
    them out (`*mmproj*.gguf` in its folder) and ollama's blob store does (its manifest's
    projector layer); None where there is none. Several: UsageError listing them."""
    model_path = Path(model_path)
    folder = model_path if model_path.is_dir() else model_path.parent
    found = sorted(
        path
        for path in folder.glob("*.gguf")
        if "mmproj" in path.name.lower() and path.resolve() != model_path.resolve()
    )
    found += [path for path in _ollama_projectors(model_path) if path not in found]
    if len(found) > 1:
        raise UsageError(
            f"several vision projectors beside {model_path}: {', '.join(str(path) for path in found)}",
            "`--mmproj FILE` chooses one",
        )
    return found[0] if found else None


def _ollama_projectors(model_path: Path) -> list[Path]:
    """The projector blobs of the ollama manifests whose model layer is this blob
    (`…/models/blobs/sha256-<hex>`, manifests under `…/models/manifests/`)."""
    if model_path.parent.name != "blobs" or not model_path.name.startswith("sha256-"):
        return []
    digest = model_path.name.replace("sha256-", "sha256:", 1)
    blobs = model_path.parent
    projectors: list[Path] = []
    for manifest in sorted((blobs.parent / "manifests").rglob("*")):
        layers = _layers(manifest)
        if any(
            layer.get("mediaType") == OLLAMA_MODEL_LAYER and layer.get("digest") == digest for layer in layers
        ):
            for layer in layers:
                if layer.get("mediaType") == OLLAMA_PROJECTOR_LAYER and isinstance(layer.get("digest"), str):
                    blob = blobs / layer["digest"].replace("sha256:", "sha256-", 1)
                    if blob not in projectors:
                        projectors.append(blob)
    return projectors


def _layers(manifest: Path) -> list[dict[str, Any]]:
    """A manifest's layers; a file that is not one (a folder, other JSON) has none."""
    if not manifest.is_file():
        return []
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return []
    return [layer for layer in layers if isinstance(layer, dict)] if isinstance(layers, list) else []
