"""A model's files as one object, each read once: what resolving a model gives, and what every
step after it (planning, building, `models show`) asks instead of going back to the folder.

Each fact is read the first time it is asked for and then kept on the object (a
`functools.cached_property`), so a load reads config.json, the safetensors headers and the GGUF
file's check once. No cache outlives the object: resolving again makes a new one, which sees a
config an update wrote since. Torch-free at import, so `--help`, `models list` and a call through
a server do not pay for it; what reads weights (gguf_direct, lean_model) is imported by the
methods that need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmcli.errors import ModelLoadError
from llmcli.models.gguf_cache import DONE_MARKER, SOURCE_FILE, recorded_source, stored_kind_of
from llmcli.models.headers import ITEMSIZE, TensorHeader, read_safetensors_header

if TYPE_CHECKING:
    import torch

    from llmcli.models.gguf_table import GGUFTable
    from llmcli.models.lean_model import TensorSource
    from llmcli.models.quantized import ExactCodes


def read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {error}") from error


def stored_generation_config(folder: Path) -> dict[str, Any]:
    """generation_config.json as written, unchecked ({} where it is missing or unreadable:
    transformers' own reading of the folder says what is wrong with it)."""
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


def check_generation_config(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The model's sampling defaults checked as a config file's values are: a NaN temperature or
    a top_p of 7 is one line naming the file, not a crash in sampling after the load."""
    from llmcli.config.settings import BUILTIN_SAMPLING, model_default_problem

    for name in BUILTIN_SAMPLING:
        value = config.get(name)
        problem = model_default_problem(name, value) if value is not None else None
        if problem is not None:
            raise ModelLoadError(
                f"{folder / 'generation_config.json'}: its {name} {problem}",
                "fix the file, or remove the key (llmcli's own default then applies)",
            )
    return config


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The model's generation_config.json, its sampling defaults checked."""
    return check_generation_config(folder, stored_generation_config(folder))


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model. Its fields are ResolvedModel's, so `ResolvedModel(name=, path=,
    source=)` builds one; everything else is read from `path` when first asked for."""

    name: str  # what to call the model in output: the spec as the user would write it
    path: Path  # a local folder in Hugging Face format (a GGUF file's small parts, read in place)
    source: str  # "hub", "folder" or "gguf"

    @cached_property
    def layout(self) -> Literal["folder", "gguf-in-place", "gguf-converted"]:
        if (self.path / SOURCE_FILE).is_file():
            return "gguf-in-place"
        return "gguf-converted" if (self.path / DONE_MARKER).is_file() else "folder"

    @property
    def read_in_place(self) -> bool:
        """A GGUF file whose weights are read from the file itself (gguf_direct.py)."""
        return self.layout == "gguf-in-place"

    @cached_property
    def gguf_file(self) -> Path | None:
        """The GGUF file a folder read in place was written for, as recorded (it may be gone)."""
        return recorded_source(self.path)

    @cached_property
    def gguf_source(self) -> Path:
        """The GGUF file read in place, checked to be there still with the content the folder was
        written for (gguf_direct.source_of): ModelLoadError otherwise."""
        from llmcli.models.gguf_direct import source_of

        return source_of(self.path)

    @cached_property
    def gguf_table(self) -> GGUFTable:
        from llmcli.models.gguf_table import read_table

        return read_table(self.gguf_source)

    @cached_property
    def config(self) -> dict[str, Any]:
        """config.json; ModelLoadError naming it where it cannot be read."""
        return read_config(self.path)

    @cached_property
    def stored_generation_config(self) -> dict[str, Any]:
        return stored_generation_config(self.path)

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json with its sampling defaults checked (read_generation_config)."""
        return check_generation_config(self.path, self.stored_generation_config)

    @cached_property
    def architecture(self) -> str:
        return str((self.config.get("architectures") or [""])[0])

    @cached_property
    def headers(self) -> dict[Path, dict[str, Any]]:
        """Each *.safetensors file's header, checked against its file, in name order: a damaged
        file is named when first asked, before any weight is read."""
        return {file: read_safetensors_header(file) for file in sorted(self.path.glob("*.safetensors"))}

    @cached_property
    def shapes(self) -> dict[str, TensorHeader]:
        """Tensor name → shape and stored element size, from the safetensors headers, or from the
        table of the GGUF file read in place (its blocks counted as 2 bytes a weight, the 16-bit
        width they are estimated against; empty where the file cannot be read: the load says
        why). No weights are read."""
        if self.read_in_place:
            from llmcli.models.gguf_direct import shapes_of_table

            try:
                return shapes_of_table(self.gguf_table)
            except ModelLoadError:
                return {}
        tensors: dict[str, TensorHeader] = {}
        for header in self.headers.values():
            for name, entry in header.items():
                if name != "__metadata__":
                    tensors[name] = TensorHeader(entry["shape"], ITEMSIZE.get(entry["dtype"], 4))
        return tensors

    @cached_property
    def stored_kind(self) -> str | None:
        """ "int4 Q4_1": what the GGUF file behind the folder stored (gguf_cache's kind file);
        None for a model that is no GGUF file, or where it cannot be known."""
        return stored_kind_of(self.path) if self.source == "gguf" else None

    @property
    def weight_kind(self) -> str | None:
        """int4, int8 or float (gguf_cache.weight_kind)."""
        return self.stored_kind.split()[0] if self.stored_kind else None

    @property
    def gguf_type(self) -> str | None:
        """GGUF's name for the type most layer weights had (Q4_1, Q8_0, F16)."""
        stored = (self.stored_kind or "").split()
        return stored[1] if len(stored) > 1 else None

    @property
    def has_tokenizer_json(self) -> bool:
        return (self.path / "tokenizer.json").is_file()

    def tensors(
        self, dtype: torch.dtype, device: torch.device, heads: tuple[int, int] | None = None
    ) -> TensorSource:
        """The weights by transformers' names, each read when asked for: from the GGUF file read
        in place (`heads`: its attention and KV heads, whose rows llama.cpp interleaved; from the
        config where not given), else from the safetensors files, whose headers are read here
        already."""
        if self.read_in_place:
            from llmcli.models.gguf_direct import GGUFTensors

            return GGUFTensors(self.gguf_source, dtype, device, heads or self._heads(), self.gguf_table)
        from llmcli.models.lean_model import Tensors

        return Tensors(self.path, dtype, device, headers=self.headers)

    def exact_codes(self) -> ExactCodes | None:
        """A GGUF file's 4-bit blocks as int4 codes: read from the file itself where it is read in
        place, else from those written beside an older conversion."""
        if self.read_in_place:
            import torch

            from llmcli.models.gguf_direct import GGUFCodes

            return GGUFCodes(self.tensors(torch.float32, torch.device("cpu")))  # type: ignore[arg-type]
        from llmcli.models.gguf_int4 import blocks_of

        return blocks_of(self.path)

    def _heads(self) -> tuple[int, int]:
        config = self.config
        return (
            config["num_attention_heads"],
            config.get("num_key_value_heads") or config["num_attention_heads"],
        )
