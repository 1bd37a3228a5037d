"""Gemma 3's vision part (Gemma3ForConditionalGeneration): its SigLIP tower and
Gemma3MultiModalProjector, transformers' own modules filled with the checkpoint's vision tensors
alone, and transformers' PIL image processor (no torchvision).

Every image is resized to the tower's square (896 × 896 for the released models) and becomes
`mm_tokens_per_image` rows (256), whatever its size. Its placeholder is what Gemma3Processor puts
where the chat template wrote `<start_of_image>`: `\\n\\n<start_of_image>` + 256 ×
`<image_soft_token>` + `<end_of_image>\\n\\n`, the blank lines tokenized alone (transformers
tokenizes them with the text around, where a tokenizer may merge them with a newline before).
Pan-and-scan crops (off in the released processor configs) are refused rather than dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmcli.errors import ModelLoadError
from llmcli.models.vision.checkpoint_part import CheckpointVision, config_of, text_ids, token_text
from llmcli.models.vision.encoder import Placeholder, PreparedImage

if TYPE_CHECKING:
    import torch
    from PIL import Image

TOWER = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."
# Around each image's tokens Gemma3Processor writes a blank line on both sides.
IMAGE_MARGIN = "\n\n"


class Gemma3Vision(CheckpointVision):
    """Gemma 3's VisionEncoder: an image's rows attend to each other both ways on every layer (a
    sliding layer still within its window), as Gemma3Model's mask for `token_type_ids` does."""

    prefixes = (TOWER, PROJECTOR)
    bidirectional = True

    def build(
        self, config: Any, tensors: Mapping[str, torch.Tensor], tokenizer: Any, settings: dict[str, Any]
    ) -> None:
        """`config`: a Gemma3Config's; `settings`: the image processor's, else the tower's image
        size with transformers' defaults."""
        from transformers import AutoModel, Gemma3Config
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config = config_of(Gemma3Config, config)
        self.bidirectional_layers = tuple(range(config.text_config.num_hidden_layers))
        self.tower = self.load(lambda: AutoModel.from_config(config.vision_config), tensors, TOWER)
        self.projector = self.load(lambda: Gemma3MultiModalProjector(config), tensors, PROJECTOR)
        rows = config.mm_tokens_per_image
        if settings.get("image_seq_length", rows) != rows:
            raise ModelLoadError(
                f"the image processor expands an image to {settings['image_seq_length']} tokens, "
                f"the model's projector makes {rows}"
            )
        if settings.get("do_pan_and_scan"):
            raise ModelLoadError(
                "the image processor asks for pan-and-scan crops, which llmcli does not make"
            )
        side = config.vision_config.image_size
        self.processor = Gemma3ImageProcessorPil.from_dict(
            settings or {"size": {"height": side, "width": side}}
        )
        self.template_text = token_text(tokenizer, config.boi_token_index)
        margin = text_ids(tokenizer, IMAGE_MARGIN)
        image = config.image_token_index
        ids = [*margin, config.boi_token_index, *[image] * rows, config.eoi_token_index, *margin]
        self.placeholder = Placeholder(ids=tuple(ids), image_token_id=image)
        edges = (token_text(tokenizer, config.boi_token_index), token_text(tokenizer, config.eoi_token_index))
        image_text = token_text(tokenizer, image) * rows
        self.expansion = f"{IMAGE_MARGIN}{edges[0]}{image_text}{edges[1]}{IMAGE_MARGIN}"

    def placeholder_text(self, prepared: PreparedImage) -> str:
        """The text Gemma3Processor writes for `template_text` (`full_image_sequence`): a prompt
        tokenized with it in the marker's place is transformers' ids, blank lines merged with
        the text around as its tokenizer merges them."""
        return self.expansion

    def prepare(self, image: Image.Image) -> PreparedImage:
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        return PreparedImage(placeholder=self.placeholder, inputs={"pixel_values": pixels})

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """Gemma3Model.get_image_features' rows for the image: the tower's last hidden state,
        pooled to `mm_tokens_per_image`, normed and projected to the decoder's width."""
        import torch

        pixels = prepared.inputs["pixel_values"].to(self.device, self.dtype)
        with torch.inference_mode():
            hidden = self.tower(pixel_values=pixels).last_hidden_state
            return self.projector(hidden)[0]
