"""What a family's vision part gives the rest of llmcli: the placeholder an image takes in the
prompt and the embeddings that replace its image tokens there.

The decoder stays on the native engine; the vision tower runs once per image (its rows are then
part of the prefix, kept and reused by content). A family module (gemma3.py, qwen_vl.py, …)
implements `VisionEncoder`; `load_vision` (vision/load.py) picks one for a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from PIL import Image


@dataclass(frozen=True)
class ImageInput:
    """An image as it came in, not yet decoded: its bytes, and how a message names it (a path,
    `--image 2`, `messages[1].content[0]`), for every error about it."""

    data: bytes
    label: str


@dataclass(frozen=True)
class Placeholder:
    """The token ids that stand for one image in the prompt, expanded as the model's processor
    expands the template's image marker (Gemma 3: `\\n\\n<start_of_image>` + 256 ×
    `<image_soft_token>` + `<end_of_image>\\n\\n`; Qwen: `<|vision_start|>` + n × `<|image_pad|>`
    + `<|vision_end|>`; SmolVLM: its tiles' row/column markers around `<image>` runs)."""

    ids: tuple[int, ...]
    # The entries of `ids` equal to this take the image's embedding rows, in order; every other
    # entry is an ordinary token the decoder embeds itself.
    image_token_id: int
    # Qwen-VL's multimodal RoPE: the image's (time, height, width) in merged patches, its rows'
    # positions laid out over that grid; None: the rows take consecutive positions as text does.
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class PreparedImage:
    """One image through the model's image processor: its placeholder, and the processor's
    outputs (pixel values and their sizes) that `encode` reads."""

    placeholder: Placeholder
    inputs: dict[str, Any]


class VisionEncoder(Protocol):
    # What the chat template writes where a message holds an image (Gemma 3: "<start_of_image>",
    # Qwen: "<|vision_start|><|image_pad|><|vision_end|>", SmolVLM: "<image>"): the text that
    # `placeholder.ids` replace.
    template_text: str
    # Whether an image's rows attend to each other both ways during a prefill, rather than
    # causally as text does, and in which decoder layers (Gemma 3: every layer; Gemma 4: its
    # sliding ones, each still within its window).
    bidirectional: bool
    bidirectional_layers: tuple[int, ...]

    def prepare(self, image: Image.Image) -> PreparedImage:
        """The image (decoded, RGB, checked: image_file.py) through the processor."""
        ...

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The image's embeddings [rows, decoder hidden], one row per image token of its
        placeholder, in the decoder's dtype, on its device."""
        ...
