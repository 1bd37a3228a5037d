"""A vision-language checkpoint's language model, read as a text model's checkpoint: its tensors
lie under `model.language_model.` where a text model's lie under `model.` (the head stays where
it is), which the lean loader reads through this view. The vision tower's tensors are never read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from llmcli.models.lean_model import TensorSource

BODY = "model."


def stored_name(name: str, language_model: str) -> str:
    """Where a text model's tensor `name` lies in a checkpoint whose language model is under
    `language_model`."""
    return f"{language_model}.{name.removeprefix(BODY)}" if name.startswith(BODY) else name


class LanguageModelTensors:
    """`tensors` (a TensorSource) by a text model's names."""

    def __init__(self, tensors: TensorSource, language_model: str) -> None:
        self.tensors, self.language_model = tensors, language_model

    def __getattr__(self, name: str) -> Any:  # dtype, device, implied_required, rope_factors
        return getattr(self.tensors, name)

    def _stored(self, name: str) -> str:
        return stored_name(name, self.language_model)

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self.tensors

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.tensors.get(self._stored(name), dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.optional(self._stored(name))

    def stand_in(self, name: str) -> torch.Tensor:
        return self.tensors.stand_in(self._stored(name))

    def embedding(self, name: str, packed: bool) -> nn.Module:
        return self.tensors.embedding(self._stored(name), packed)
