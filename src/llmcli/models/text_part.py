"""A multimodal checkpoint's language model read as a text model's: its tensors under the names
a text checkpoint gives them (`model.language_model.layers.…` read as `model.layers.…`), so the
lean model is built from them as from any other (lean_model.build). The vision and audio towers
are never read; images are refused where they could be given (issue 46 adds them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from llmcli.models.lean_model import TensorSource


class TextPart:
    """`tensors` with `model.X` read as `<prefix>.X`; other names (lm_head.weight) as they are."""

    def __init__(self, tensors: TensorSource, prefix: str) -> None:
        self._tensors, self._prefix = tensors, prefix
        self.dtype, self.device = tensors.dtype, tensors.device
        self.implied_required = tensors.implied_required

    def _name(self, name: str) -> str:
        return self._prefix + name.removeprefix("model") if name.startswith("model.") else name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self._tensors

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._tensors.get(self._name(name), dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self._tensors.optional(self._name(name))

    def stand_in(self, name: str) -> torch.Tensor:
        return self._tensors.stand_in(self._name(name))

    def embedding(self, name: str, packed: bool) -> nn.Module:
        return self._tensors.embedding(self._name(name), packed)

    def rope_factors(self) -> torch.Tensor | None:
        return self._tensors.rope_factors()
