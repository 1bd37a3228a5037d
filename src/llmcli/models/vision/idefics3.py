"""SmolVLM's and Idefics3's vision part: a SigLIP tower and a connector (pixel shuffle, then one
linear layer) from transformers' own modules, run once per image; the decoder (a Llama) stays on
the native engine.

An image is split into square tiles (rows × columns of them, plus the whole image shrunk to one
tile) by transformers' PIL image processor, as the checkpoint's processor does; each tile gives
`image_seq_len` rows. The placeholder is the processor's expansion of the template's `<image>`:
per tile `<fake_token_around_image><row_i_col_j>` and its run of `<image>`, a newline after each
row of tiles, then `\\n<fake_token_around_image><global-img>`, the whole image's run and a closing
`<fake_token_around_image>`. Only the runs of `<image>` take the encoder's rows; the markers are
ordinary tokens.

transformers is imported inside functions only, so a text-only call never pays for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.errors import ModelLoadError
from llmcli.models.vision.encoder import Placeholder, PreparedImage

if TYPE_CHECKING:
    import torch
    from PIL import Image

# Where the checkpoint keeps the vision tower's and the connector's tensors (the language model's,
# under model.text_model., are never read here).
VISION_PREFIXES = ("model.vision_model.", "model.connector.")
IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
# config.json's model_type -> (transformers' module, its class prefix).
_FAMILIES = {"smolvlm": ("smolvlm", "SmolVLM"), "idefics3": ("idefics3", "Idefics3")}

Tokenize = Callable[[str], Sequence[int]]


def placeholder_text(rows: int, cols: int, image_seq_len: int) -> str:
    """The processor's expansion of one `<image>` for an image split into rows × cols tiles
    (0 × 0: not split), as processing_idefics3.py / processing_smolvlm.py write it."""
    run = IMAGE_TOKEN * image_seq_len
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{run}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return whole
    tiles = "".join(
        "".join(f"{FAKE_TOKEN}<row_{row + 1}_col_{col + 1}>{run}" for col in range(cols)) + "\n"
        for row in range(rows)
    )
    return f"{tiles}\n{whole}"


def _modules(model_type: str) -> Any:
    import importlib

    if model_type not in _FAMILIES:
        raise ModelLoadError(f"not a SmolVLM or Idefics3 checkpoint (model_type {model_type!r})")
    name, _ = _FAMILIES[model_type]
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _image_processor_class(model_type: str) -> Any:
    import importlib

    name, prefix = _FAMILIES[model_type]
    module = importlib.import_module(f"transformers.models.{name}.image_processing_pil_{name}")
    return getattr(module, f"{prefix}ImageProcessorPil")


class Idefics3Vision:
    """The `VisionEncoder` of SmolVLM and Idefics3 checkpoints."""

    template_text = IMAGE_TOKEN
    bidirectional = False

    def __init__(
        self,
        config: Any,
        tensors: Mapping[str, torch.Tensor],
        image_processor: Any = None,
        tokenize: Tokenize | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """`config`: the whole checkpoint's transformers config (SmolVLMConfig / Idefics3Config);
        `tensors`: its vision tower's and connector's tensors by their names in the checkpoint;
        `image_processor` and `tokenize` (text -> ids, no special tokens added) are what `prepare`
        needs, `encode` alone needs neither."""
        import torch

        modeling = _modules(config.model_type)
        _, prefix = _FAMILIES[config.model_type]
        self.dtype = dtype or next(iter(tensors.values())).dtype
        self.device = torch.device(device)
        self.patch_size = config.vision_config.patch_size
        scale = config.scale_factor
        self.image_seq_len = (config.vision_config.image_size // self.patch_size) ** 2 // (scale * scale)
        # Built without weights (no random init of a tower of hundreds of millions), then given
        # the checkpoint's tensors as they are.
        with torch.device("meta"):
            self.vision_model = getattr(modeling, f"{prefix}VisionTransformer")(config.vision_config)
            self.connector = getattr(modeling, f"{prefix}Connector")(config)
        for module, stored in ((self.vision_model, VISION_PREFIXES[0]), (self.connector, VISION_PREFIXES[1])):
            own = {name.removeprefix(stored): t for name, t in tensors.items() if name.startswith(stored)}
            module.load_state_dict(own, strict=True, assign=True)
            module.to(dtype=self.dtype, device=self.device).eval()
        self.image_processor, self.tokenize = image_processor, tokenize
        self.image_token_id = self._single_id(IMAGE_TOKEN) if tokenize is not None else None

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        tokenize: Tokenize | None = None,
        tokenizer: Any = None,
    ) -> Idefics3Vision:
        """The vision part of the checkpoint in `folder`: its config.json, the vision and connector
        tensors of its safetensors (nothing else is read), its preprocessor_config.json, and its
        tokenizer.json unless `tokenize` or `tokenizer` (the engine's, so both agree) is given."""
        from transformers import AutoConfig

        folder = Path(folder)
        if tokenize is None and tokenizer is not None:

            def tokenize(text: str) -> list[int]:
                return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        config = AutoConfig.from_pretrained(folder)
        return cls(
            config,
            _vision_tensors(folder),
            _image_processor(folder, config.model_type),
            tokenize or _folder_tokenizer(folder),
            dtype=dtype,
            device=device,
        )

    def _single_id(self, token: str) -> int:
        assert self.tokenize is not None
        ids = list(self.tokenize(token))
        if len(ids) != 1:
            raise ModelLoadError(f"the tokenizer has no {token} token (it reads as {len(ids)} tokens)")
        return ids[0]

    def prepare(self, image: Image.Image) -> PreparedImage:
        if self.image_processor is None or self.tokenize is None or self.image_token_id is None:
            raise ModelLoadError("this vision encoder was built without an image processor and a tokenizer")
        out = self.image_processor(images=[image], return_tensors="pt", return_row_col_info=True)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        ids = tuple(self.tokenize(placeholder_text(rows, cols, self.image_seq_len)))
        inputs = {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}
        return PreparedImage(Placeholder(ids, self.image_token_id), inputs)

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """As get_image_features: every tile through the tower, the patches the processor padded
        masked out, then the connector; the tiles' rows one after another, as inputs_merger's
        masked_scatter lays them over the `<image>` tokens."""
        import torch

        pixels = prepared.inputs["pixel_values"].to(self.device, self.dtype).flatten(0, 1)
        mask = prepared.inputs["pixel_attention_mask"].to(self.device).flatten(0, 1)
        # The processor pads a batch with all-zero images; transformers drops them (one image here
        # has none, but pixel values from elsewhere might).
        real = (pixels != 0).flatten(1).any(dim=1)
        pixels, mask = pixels[real], mask[real]
        size = self.patch_size
        patches = mask.unfold(1, size, size).unfold(2, size, size)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        with torch.inference_mode():
            hidden = self.vision_model(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state
            features = self.connector(hidden)
        return features.reshape(-1, features.shape[-1])


def _image_processor(folder: Path, model_type: str) -> Any:
    """transformers' PIL image processor (never the torchvision one) with the settings of the
    folder's preprocessor_config.json, read as transformers reads them."""
    path = folder / "preprocessor_config.json"
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: cannot read the image processor's settings ({error})") from None
    return _image_processor_class(model_type).from_dict(settings)


def _vision_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The vision tower's and connector's tensors from the folder's safetensors, read by name so
    the language model's never leave the disk."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as stored:
            for name in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(VISION_PREFIXES):
                    tensors[name] = stored.get_tensor(name)
    if not tensors:
        raise ModelLoadError(f"{folder}: no vision tower tensors ({', '.join(VISION_PREFIXES)})")
    return tensors


def _folder_tokenizer(folder: Path) -> Tokenize:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids
