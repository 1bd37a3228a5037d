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
}


@dataclass
class VisionSource:
    """A checkpoint's vision tower and projector, not loaded yet: where they are, and for what."""

    architecture: str
    folder: Path
    dtype: torch.dtype
    device: torch.device
    tokenizer: Any
    pad_id: int  # the id the decoder embeds at an image's rows before they are replaced (Gemma 4 reads it)
    # The engine's table of this model's images (engine/image_rows.py), made on first use.
    table: Any = field(default=None, repr=False)
    _encoder: VisionEncoder | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encoder(self) -> VisionEncoder:
        with self._lock:
            if self._encoder is None:
                module, name = ENCODERS[self.architecture]
                kind = getattr(importlib.import_module(f"llmcli.models.vision.{module}"), name)
                folder, tokenizer = self.folder, self.tokenizer
                self._encoder = kind.from_folder(folder, self.dtype, self.device, tokenizer=tokenizer)
            return self._encoder


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
) -> VisionSource | None:
    """The checkpoint's vision part where llmcli reads images of its architecture; else None."""
    if architecture not in ENCODERS:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    return VisionSource(architecture, folder, dtype, device, tokenizer, pad if isinstance(pad, int) else 0)
