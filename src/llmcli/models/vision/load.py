"""Which vision part a checkpoint has, found at load without reading it: the tower is built on
the first image (it runs once per image), so a text-only call starts as lean as before.

A family module gives a class with `from_folder(folder, dtype, device, tokenizer)`; this table
names it per architecture (the class in the checkpoint's config.json)."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from llmcli.models.vision.encoder import PreparedImage, VisionEncoder

# architecture → (module under llmcli.models.vision, class)
ENCODERS: dict[str, tuple[str, str]] = {
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3Vision"),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4Vision"),
    "Qwen3_5ForConditionalGeneration": ("qwen_vl", "QwenVisionEncoder"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen_vl", "QwenVisionEncoder"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen_vl", "QwenVisionEncoder"),
    "SmolVLMForConditionalGeneration": ("idefics3", "Idefics3Vision"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3Vision"),
}


# The image tokens a projector type's decoder spells, by the whole model's config names: a GGUF
# model's ids are its own vocabulary's (Qwen's config defaults are the released vocabulary's).
GGUF_IMAGE_TOKENS: dict[str, dict[str, str]] = {
    "gemma3": {
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
    },
    "qwen3vl_merger": {
        "vision_start_token_id": "<|vision_start|>",
        "image_token_id": "<|image_pad|>",
        "vision_end_token_id": "<|vision_end|>",
    },
}


@dataclass
class VisionSource:
    """A checkpoint's vision tower and projector, not loaded yet: where they are, and for what."""

    architecture: str
    folder: Path  # the checkpoint's, or (with `mmproj`) the text GGUF's cache folder
    dtype: torch.dtype
    device: torch.device
    tokenizer: Any
    pad_id: int  # the id the decoder embeds at an image's rows before they are replaced (Gemma 4 reads it)
    # A GGUF model's vision part: llama.cpp's projector file, read beside its decoder's config.
    mmproj: Path | None = None
    text_config: Any = field(default=None, repr=False)
    # The engine's table of this model's images (engine/image_rows.py), made on first use.
    table: Any = field(default=None, repr=False)
    _encoder: VisionEncoder | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encoder(self) -> VisionEncoder:
        with self._lock:
            if self._encoder is None:
                module, name = ENCODERS[self.architecture]
                kind = getattr(importlib.import_module(f"llmcli.models.vision.{module}"), name)
                if self.mmproj is not None:
                    self._encoder = self._from_mmproj(kind)
                else:
                    folder, tokenizer = self.folder, self.tokenizer
                    self._encoder = kind.from_folder(folder, self.dtype, self.device, tokenizer=tokenizer)
            return self._encoder

    def _from_mmproj(self, kind: Any) -> VisionEncoder:
        """The family's encoder over the projector file's tower, its image tokens as the text
        model's tokenizer spells them."""
        from llmcli.models.vision.mmproj import read_mmproj

        assert self.mmproj is not None
        contents = read_mmproj(self.mmproj)
        tokens = GGUF_IMAGE_TOKENS.get(contents.projector_type, {})
        ids = {name: self.tokenizer.convert_tokens_to_ids(text) for name, text in tokens.items()}
        config = contents.model_config(text_config_of(self.text_config), **ids)
        settings = contents.processor_settings
        if kind.__name__ == "QwenVisionEncoder":  # the released sizes under the file's mean and std
            from llmcli.models.vision.qwen_vl import FAMILIES

            settings = FAMILIES[self.architecture].processor_defaults | settings
            return kind(
                config, contents.tensors, processor_settings=settings, dtype=self.dtype, device=self.device
            )
        return kind(
            config,
            contents.tensors,
            self.tokenizer,
            processor_settings=settings,
            dtype=self.dtype,
            device=self.device,
        )


class LazyEncoder:
    """A VisionEncoder that builds the real one on first use (any attribute a family adds, such
    as which layers read an image both ways, read through to it)."""

    def __init__(self, source: VisionSource) -> None:
        self.source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source.encoder(), name)

    def prepare(self, image: Image.Image) -> PreparedImage:
        return self.source.encoder().prepare(image)

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        return self.source.encoder().encode(prepared)


def vision_source(
    architecture: str | None,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: Any,
    config: Any,
    gguf: tuple[Path, str | None] | None = None,
) -> VisionSource | None:
    """The checkpoint's vision part where llmcli reads images of its architecture; else None.
    `gguf`: a GGUF model's file and `--mmproj` as given: its vision part is llama.cpp's
    projector file, the one named or found beside the model as llama.cpp and ollama lay them
    out, checked now (its header: one line naming it where it is not a projector llmcli reads),
    its tower read on the first image."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    pad_id = pad if isinstance(pad, int) else 0
    if gguf is None:
        return (
            VisionSource(architecture, folder, dtype, device, tokenizer, pad_id)
            if architecture in ENCODERS
            else None
        )
    from llmcli.models.vision.mmproj import find_mmproj, projector_architecture

    model_file, asked = gguf
    path = Path(asked).expanduser() if asked else find_mmproj(model_file)
    if path is None:
        return None
    architecture = projector_architecture(path, config)
    if architecture not in ENCODERS:  # Qwen2.5-VL's, Qwen3-VL's: their decoders' GGUF files are not read
        if asked:
            raise ModelLoadError(f"{path}: the images of a {architecture} are not read by llmcli yet")
        return None
    return VisionSource(
        architecture, folder, dtype, device, tokenizer, pad_id, mmproj=path, text_config=config
    )


def text_config_of(config: Any) -> Any:
    """A decoder's config as transformers' class for it (from a lean loader's LeanConfig)."""
    from transformers import AutoConfig, PreTrainedConfig

    if isinstance(config, PreTrainedConfig):
        return config
    values = dict(config._values)
    return AutoConfig.for_model(values.pop("model_type"), **values)
