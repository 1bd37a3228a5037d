"""Gemma 4's vision part (Gemma4ForConditionalGeneration): its vision tower (Gemma4VisionModel)
and the embedder that projects the tower's rows into the decoder's width
(Gemma4MultimodalEmbedder), transformers' own modules filled with the checkpoint's vision tensors
alone, and transformers' PIL image processor (no torchvision).

An image keeps its aspect ratio: resized to fit `max_soft_tokens` (280 in the released configs)
pooled rows of pooling_kernel_size² patches, so its row count depends on its size. Its
placeholder is what Gemma4Processor puts where the chat template wrote `<|image|>`:
`<|image>` + n × `<|image|>` + `<image|>`, nothing around it.

For the decoder (the engine's side, not done here): Gemma4Model embeds the image's positions as
the pad token where it computes the per-layer inputs (`hidden_size_per_layer_input`), so a row
of the image reads the pad token's per-layer embedding, and the image's own rows replace only the
main embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmcli.errors import ModelLoadError
from llmcli.models.vision.checkpoint_part import CheckpointVision, config_of, token_text
from llmcli.models.vision.encoder import Placeholder, PreparedImage

if TYPE_CHECKING:
    import torch
    from PIL import Image

TOWER = "model.vision_tower."
EMBEDDER = "model.embed_vision."
# The processor's settings that must be the tower's: the patches it cuts and how it pools them.
TOWER_SETTINGS = ("patch_size", "pooling_kernel_size")


class Gemma4Vision(CheckpointVision):
    """Gemma 4's VisionEncoder. Where the text config's `use_bidirectional_attention` is
    "vision" (the larger released models), an image's rows attend to each other both ways on the
    sliding layers alone (`bidirectional_layers`, each still within its window) and causally on
    the full ones, as Gemma4Model's create_masks_for_vision_model does; elsewhere causally."""

    prefixes = (TOWER, EMBEDDER)

    def build(
        self, config: Any, tensors: Mapping[str, torch.Tensor], tokenizer: Any, settings: dict[str, Any]
    ) -> None:
        """`config`: a Gemma4Config's; `settings`: the image processor's, else the tower's patch
        size and pooling with transformers' defaults."""
        from transformers import AutoModel, Gemma4Config
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        config = config_of(Gemma4Config, config)
        if config.vision_config is None:
            raise ModelLoadError("its config has no vision_config: this Gemma 4 reads no images")
        vision, text = config.vision_config, config.text_config
        self.tower = self.load(lambda: AutoModel.from_config(vision), tensors, TOWER)
        self.embedder = self.load(lambda: Gemma4MultimodalEmbedder(vision, text), tensors, EMBEDDER)
        tower_settings = {name: getattr(vision, name) for name in TOWER_SETTINGS}
        settings = tower_settings | settings
        for name, value in tower_settings.items():
            if settings[name] != value:
                raise ModelLoadError(
                    f"the image processor's {name} is {settings[name]}, its vision tower's {value}"
                )
        self.processor = Gemma4ImageProcessorPil.from_dict(settings)
        self.bidirectional = text.use_bidirectional_attention == "vision"
        kinds = list(text.layer_types)
        self.bidirectional_layers = tuple(
            layer for layer, kind in enumerate(kinds) if self.bidirectional and kind == "sliding_attention"
        )
        self.template_text = token_text(tokenizer, config.image_token_id)
        self.image_token_id = config.image_token_id
        self.edges = (config.boi_token_id, config.eoi_token_id)
        self.edge_texts = tuple(token_text(tokenizer, edge) for edge in self.edges)

    def prepare(self, image: Image.Image) -> PreparedImage:
        processed = self.processor(images=[image], return_tensors="pt")
        rows = int(processed["num_soft_tokens_per_image"][0])
        begin, end = self.edges
        placeholder = Placeholder(
            ids=(begin, *[self.image_token_id] * rows, end), image_token_id=self.image_token_id
        )
        inputs = {
            "pixel_values": processed["pixel_values"],
            "image_position_ids": processed["image_position_ids"],
        }
        return PreparedImage(placeholder=placeholder, inputs=inputs)

    def placeholder_text(self, prepared: PreparedImage) -> str:
        """The text Gemma4Processor.replace_image_token writes for `template_text` (special
        tokens alone, so tokenizing it gives `placeholder.ids` in any context)."""
        rows = prepared.placeholder.ids.count(self.image_token_id)
        return f"{self.edge_texts[0]}{self.template_text * rows}{self.edge_texts[1]}"

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """Gemma4Model.get_image_features' rows for the image (what its forward scatters into the
        image tokens' embeddings): the tower's pooled rows, padding stripped, normed and projected
        to the decoder's width."""
        import torch

        pixels = prepared.inputs["pixel_values"].to(self.device, self.dtype)
        positions = prepared.inputs["image_position_ids"].to(self.device)
        with torch.inference_mode():
            hidden = self.tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
            return self.embedder(inputs_embeds=hidden)
