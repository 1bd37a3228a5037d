"""The vision part of a vision-language checkpoint folder, read apart from its language model:
the tensors under the vision tower's and projector's prefixes (never a language-model tensor: a
27B Gemma 3's text weights are 50 GB the native engine reads on its own), the image processor's
settings, and transformers' modules filled with those tensors. `CheckpointVision` is what a
family's class (gemma3.py, gemma4.py) shares: built from what any reader gives (a folder here, a
GGUF mmproj file elsewhere), or from a folder.

transformers is imported inside the functions that build modules, so importing this module costs
nothing a text-only call would notice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from llmcli.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

# transformers 5 names a vision-language model's parts under `model.` (its model's state_dict);
# Gemma 3's files name them without it (`vision_tower.…`: the layout Google released, which
# transformers 5 still saves), and the released ones keep SigLIP's `vision_model.` level, which
# transformers 5's SiglipVisionModel dropped. Both are read here under transformers 5's names.
HF_ROOT = "model."
LEGACY_LEVELS = (("model.vision_tower.vision_model.", "model.vision_tower."),)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def read_vision_tensors(folder: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The folder's tensors whose transformers name starts with one of `prefixes`, as stored
    (dtype included), keyed by that name; each other tensor's bytes are never read."""
    from llmcli.models.folder_check import weight_files
    from llmcli.models.tensor_file import TensorFile

    files = [name for name in weight_files(folder) if name.endswith(".safetensors")]
    if not files:
        raise ModelLoadError(f"{folder} has no safetensors files to read its vision tower from")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        stored = TensorFile(folder / name)
        names = stored.keys()  # read from the header alone
        for key in names:
            hf_name = transformers_name(key)
            if hf_name.startswith(prefixes):
                tensors[hf_name] = stored.get(key)
    if not tensors:
        raise ModelLoadError(
            f"{folder} holds no tensors under {', '.join(prefixes)}: no vision tower to read"
        )
    return tensors


def transformers_name(stored: str) -> str:
    """A tensor's name in transformers 5's model, from its name in the file."""
    name = stored if stored.startswith(HF_ROOT) else HF_ROOT + stored
    for level, replacement in LEGACY_LEVELS:
        if name.startswith(level):
            name = replacement + name[len(level) :]
    return name


def read_processor_settings(folder: Path) -> dict[str, Any]:
    """The image processor's settings as the folder saves them: preprocessor_config.json (flat,
    as transformers 4 wrote it) or processor_config.json's `image_processor` (transformers 5),
    with the processor's own keys (`image_seq_length`) beside them; {} where neither is present."""
    for name in PROCESSOR_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ModelLoadError(f"cannot read {path}: {error}") from error
        if not isinstance(saved, dict):
            raise ModelLoadError(f"{path} is not a JSON object")
        nested = saved.get("image_processor")
        return (
            (nested | {k: v for k, v in saved.items() if k != "image_processor"})
            if isinstance(nested, dict)
            else saved
        )
    return {}


def config_of(config_class: Any, config: Any) -> Any:
    """`config` (config.json's dict, or transformers' config object already) as `config_class`."""
    return config_class.from_dict(config) if isinstance(config, Mapping) else config


def load_module(
    build: Callable[[], torch.nn.Module],
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.nn.Module:
    """The module `build` makes (its random initialisation skipped), filled with the tensors
    under `prefix`, every one of its parameters and saved buffers found there, in `dtype` on
    `device`, in eval mode."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        module = build()
    state = {name[len(prefix) :]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(
            f"the tensors under {prefix} do not fit the config's {type(module).__name__}: "
            f"missing {', '.join(missing[:3]) or 'none'}; unexpected {', '.join(unexpected[:3]) or 'none'}"
        )
    return module.to(device=device, dtype=dtype).eval()


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids alone, as the model's tokenizer (transformers' or llmcli's lean one) gives them."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of a special token the config names by id (Gemma's `<start_of_image>`)."""
    text = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(text, str):
        raise ModelLoadError(
            f"the tokenizer has no token {token_id}, which the config names as an image token"
        )
    return text


class CheckpointVision:
    """A family's vision part, built from the whole model's config (config.json's dict or
    transformers' config object), its vision tensors by transformers' names (others ignored), the
    model's tokenizer (for the placeholder's text and ids: transformers' or llmcli's lean one)
    and the saved image processor's settings ({}: the config's defaults); in `dtype` on `device`."""

    # Where the family's vision tensors lie, by transformers' names.
    prefixes: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        config: Any,
        tensors: Mapping[str, torch.Tensor],
        tokenizer: Any,
        *,
        processor_settings: Mapping[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        import torch

        self.dtype = dtype or torch.float32
        self.device = torch.device(device)
        self.build(config, tensors, tokenizer, dict(processor_settings or {}))

    def build(
        self, config: Any, tensors: Mapping[str, torch.Tensor], tokenizer: Any, settings: dict[str, Any]
    ) -> None:
        """The family's modules, image processor and placeholder."""
        raise NotImplementedError

    def load(
        self, build: Callable[[], torch.nn.Module], tensors: Mapping[str, torch.Tensor], prefix: str
    ) -> Any:
        return load_module(build, tensors, prefix, self.dtype, self.device)

    @classmethod
    def from_folder(
        cls, folder: Path, dtype: torch.dtype, device: torch.device | str, *, tokenizer: Any
    ) -> Self:
        """The vision part of a checkpoint folder, its language model unread."""
        from llmcli.models.checkpoint import read_config

        tensors = read_vision_tensors(folder, cls.prefixes)
        settings = read_processor_settings(folder)
        return cls(
            read_config(folder), tensors, tokenizer, processor_settings=settings, dtype=dtype, device=device
        )
