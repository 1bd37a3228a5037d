"""Qwen's vision tower (Qwen2.5-VL, Qwen3-VL, Qwen3.5 dense and MoE): an image through Qwen's
PIL image processor (resized to a multiple of patch × merge, cut into patches), the tower and its
patch merger on transformers' own modules, one row per 2×2 merged patch, each as wide as the
decoder.

The families differ only in data (`QwenVisionFamily`): where their processor's defaults differ
from Qwen2-VL's, and whether the tower also gives Qwen3-VL's "deepstack" rows. Only the vision
tensors of a checkpoint are read (`model.visual.…`, or `visual.…` as Qwen2.5-VL's released files
name them), never the language model's. transformers is imported inside functions: importing this
module costs a text-only call nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.errors import ModelLoadError, UsageError
from llmcli.models.vision.encoder import Placeholder, PreparedImage

if TYPE_CHECKING:
    import torch
    from PIL import Image

# Where a checkpoint keeps the tower's tensors: transformers 5's name, and the released
# Qwen2.5-VL files' (transformers renames `visual.` to `model.visual.` on load).
VISION_PREFIXES = ("model.visual.", "visual.")
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
TEMPLATE_TEXT = VISION_START + IMAGE_PAD + VISION_END
# transformers' smart_resize refuses images whose sides differ more than this (it would resize
# one side below a patch).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenVisionFamily:
    # The image processor's settings where there is no preprocessor config (a GGUF mmproj has
    # none): the released checkpoints' (Qwen2.5-VL: CLIP's normalisation, 4 to 16384 merged
    # patches of 28 × 28 pixels; Qwen3-VL and Qwen3.5: to [-1, 1], 64 to 16384 of 32 × 32).
    processor_defaults: dict[str, Any] = field(default_factory=dict)
    # Qwen3-VL: rows from some of the tower's blocks are added to the first decoder layers'
    # outputs at the image's positions (the engine does not yet: encode refuses).
    deepstack: bool = False


_QWEN3_PROCESSOR = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
FAMILIES: dict[str, QwenVisionFamily] = {
    "Qwen2_5_VLForConditionalGeneration": QwenVisionFamily({"min_pixels": 3136, "max_pixels": 12845056}),
    "Qwen3_5ForConditionalGeneration": QwenVisionFamily(_QWEN3_PROCESSOR),
    "Qwen3_5MoeForConditionalGeneration": QwenVisionFamily(_QWEN3_PROCESSOR),
    "Qwen3VLForConditionalGeneration": QwenVisionFamily(_QWEN3_PROCESSOR, deepstack=True),
}


def family_of(config: Any) -> QwenVisionFamily:
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture not in FAMILIES:
        raise ModelLoadError(f"{architecture} is not a Qwen vision-language model llmcli reads images for")
    return FAMILIES[architecture]


class QwenVisionEncoder:
    """`VisionEncoder` for Qwen's vision-language checkpoints."""

    template_text = TEMPLATE_TEXT
    bidirectional = False

    def __init__(
        self,
        config: Any,
        tensors: Mapping[str, torch.Tensor],
        *,
        processor_settings: Mapping[str, Any] | None = None,
        token_ids: Mapping[str, int] | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        """`config`: the whole model's (a transformers config, or config.json as a dict);
        `tensors`: the tower's, named as transformers names them under the tower
        (`blocks.0.attn.qkv.weight`), or with the checkpoint's `model.visual.`/`visual.` before;
        `processor_settings`: preprocessor_config.json's (None: the family's defaults);
        `token_ids`: the vision tokens' ids by text (None: config.json's)."""
        import torch

        self.config = _transformers_config(config)
        self.family = family_of(self.config)
        vision = self.config.vision_config
        self.merge = vision.spatial_merge_size
        self.processor = _image_processor(vision, self.family, processor_settings)
        self.start_id, self.image_id, self.end_id = _vision_token_ids(self.config, token_ids)
        self.dtype = dtype or torch.float32
        self.tower = _build_tower(vision, _under_tower(tensors), self.dtype, device)

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        tokenizer: Any = None,
    ) -> QwenVisionEncoder:
        """The encoder of a checkpoint folder: its config.json, its vision tensors alone, its
        preprocessor config where it has one, and the vision tokens' ids as `tokenizer` (when
        given) spells them."""
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        token_ids = None
        if tokenizer is not None:
            token_ids = dict(zip(TOKENS, tokenizer.convert_tokens_to_ids(list(TOKENS)), strict=True))
        return cls(
            config,
            read_vision_tensors(folder),
            processor_settings=read_processor_settings(folder),
            token_ids=token_ids,
            dtype=dtype,
            device=device,
        )

    def prepare(self, image: Image.Image) -> PreparedImage:
        """The processor's patches and grid for `image`, and its placeholder: the template's
        marker with `<|image_pad|>` repeated once per merged patch, as Qwen's processors expand it."""
        width, height = image.size
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise UsageError(
                f"the image is {width}×{height}: Qwen's image processor takes no image whose longer side "
                f"is over {MAX_ASPECT_RATIO} times its shorter one"
            )
        inputs = dict(self.processor(images=[image], return_tensors="pt"))
        t, h, w = (int(size) for size in inputs["image_grid_thw"][0])
        grid = (t, h // self.merge, w // self.merge)
        ids = (self.start_id, *[self.image_id] * (grid[0] * grid[1] * grid[2]), self.end_id)
        return PreparedImage(Placeholder(ids, self.image_id, grid), inputs)

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The merger's rows for the image [merged patches, decoder hidden], as transformers'
        `get_image_features` gives them. Refused for Qwen3-VL, whose decoder needs its deepstack
        rows too (`encode_with_deepstack`): its rows alone would answer wrongly, not fail."""
        if self.family.deepstack:
            raise ModelLoadError(
                "Qwen3-VL's images also feed its first decoder layers (deepstack rows), which llmcli's "
                "decoder does not take yet"
            )
        return self._tower_output(prepared).pooler_output

    def encode_with_deepstack(self, prepared: PreparedImage) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Qwen3-VL: the image's rows, and for decoder layers 0, 1, … the rows added to each
        one's output at the image's positions (transformers' `deepstack_features`, one per
        `deepstack_visual_indexes` entry); no such rows for the other families."""
        output = self._tower_output(prepared)
        return output.pooler_output, list(getattr(output, "deepstack_features", None) or [])

    def _tower_output(self, prepared: PreparedImage) -> Any:
        import torch

        tower = self.tower
        with torch.inference_mode():
            pixels = prepared.inputs["pixel_values"].to(device=tower.device, dtype=tower.dtype)
            grid = prepared.inputs["image_grid_thw"].to(tower.device)
            return tower(pixels, grid_thw=grid, return_dict=True)


TOKENS = (VISION_START, IMAGE_PAD, VISION_END)
_CONFIG_TOKEN_IDS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")


def _vision_token_ids(config: Any, token_ids: Mapping[str, int] | None) -> tuple[int, int, int]:
    """The ids of the vision start, image pad and vision end tokens: the tokenizer's where given,
    which must agree with the image token the model was trained to find (config.json's)."""
    from_config = tuple(getattr(config, name, None) for name in _CONFIG_TOKEN_IDS)
    if token_ids is None:
        if None in from_config:
            raise ModelLoadError("config.json names no ids for the vision tokens and no tokenizer was given")
        return from_config  # type: ignore[return-value]
    ids = tuple(token_ids.get(token) for token in TOKENS)
    missing = [token for token, token_id in zip(TOKENS, ids, strict=True) if token_id is None]
    if missing:
        raise ModelLoadError(f"the tokenizer has no {', '.join(missing)} token: it cannot hold an image")
    for name, ours, theirs in zip(_CONFIG_TOKEN_IDS, ids, from_config, strict=True):
        if theirs is not None and ours != theirs:
            raise ModelLoadError(f"the tokenizer's id for {name} is {ours}, config.json's {theirs}")
    return ids  # type: ignore[return-value]


def _transformers_config(config: Any) -> Any:
    """A transformers config from config.json's dict (or the config itself)."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    settings = dict(config)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def _under_tower(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors named as the tower's own modules name them."""
    renamed = {}
    for name, tensor in tensors.items():
        for prefix in VISION_PREFIXES:
            if name.startswith(prefix):
                name = name.removeprefix(prefix)
                break
        renamed[name] = tensor
    return renamed


def _build_tower(vision: Any, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: Any) -> Any:
    """transformers' tower for `vision` (the class transformers' whole model builds) in `dtype`,
    holding `tensors` and nothing else: a tensor it lacks or does not take is refused."""
    from transformers import AutoModel
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten: random init would only cost time
        tower = AutoModel.from_config(vision, dtype=dtype)
    own = tower.state_dict()
    missing, unknown = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
    if missing or unknown:
        raise ModelLoadError(
            f"the checkpoint's vision tensors do not fit its config: missing {missing[:3]}, "
            f"unexpected {unknown[:3]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ModelLoadError(
                f"vision tensor {name} is {list(tensor.shape)}, its config says {list(own[name].shape)}"
            )
    tower.load_state_dict(tensors, strict=True)
    return tower.to(device).eval()


def _image_processor(vision: Any, family: QwenVisionFamily, settings: Mapping[str, Any] | None) -> Any:
    """transformers' PIL image processor for Qwen (no torchvision), from the folder's settings or
    the family's defaults, its patch sizes those the tower was built for."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    own = dict(family.processor_defaults if settings is None else settings)
    tower_sizes = {
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
    }
    if settings is None:
        own |= tower_sizes
    processor = Qwen2VLImageProcessorPil(
        **{key: value for key, value in own.items() if key in _PROCESSOR_KEYS}
    )
    for name, size in tower_sizes.items():
        if getattr(processor, name) != size:
            raise ModelLoadError(
                f"the image processor's {name} is {getattr(processor, name)}, the vision tower's {size}"
            )
    return processor


_PROCESSOR_KEYS = frozenset(
    ["size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
     "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "resample"]
)  # fmt: skip


def read_processor_settings(folder: Path) -> dict[str, Any] | None:
    """The image processor's settings as the folder saves them: preprocessor_config.json (as the
    released checkpoints do), or processor_config.json's `image_processor` (transformers 5 saves
    so); None where neither is there."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = folder / name
        if path.is_file():
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as error:
                raise ModelLoadError(f"{path} is not readable JSON: {error}") from None
            settings = saved if key is None else saved.get(key)
            if isinstance(settings, dict):
                return settings
    return None


def read_vision_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under the vision tower's prefixes, as stored; no other tensor's bytes
    are read."""
    from safetensors import safe_open

    from llmcli.models.folder_check import weight_files

    tensors = {}
    for name in weight_files(folder):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(str(folder / name), framework="pt") as stored:
            names = stored.keys()  # safe_open's handle is not iterable
            for key in names:
                if key.startswith(VISION_PREFIXES):
                    tensors[key] = stored.get_tensor(key)
    if not tensors:
        raise ModelLoadError(f"{folder} holds no vision tensors (under {' or '.join(VISION_PREFIXES)})")
    return tensors
