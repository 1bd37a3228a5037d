"""The Backend protocol: what the loop, chat and bench need from whatever runs the forward pass.

Two implement it: the native engine (llmcli's own forward for the Llama family) and transformers
(any other architecture, and the reference). Both hold a KV cache of `length` positions; the
loop keeps the token ids that fill it and never asks which backend it talks to.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Saved(Protocol):
    def nbytes(self) -> int: ...

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` positions, a cache restored from this copy can
        be cropped to."""
        ...


class Backend(Protocol):
    name: str  # "native" or "transformers", as --json, /show and bench report it
    device: torch.device

    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        ...

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after what is cached, in one pass; the logits for the next token, [1, vocab]."""
        ...

    def score(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after what is cached, in one pass; the logits after each of them, [len(ids), vocab].

        How speculative decoding checks drafted tokens: one read of the weights for them all."""
        ...

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one sampled token (a [1] tensor on the device); logits for the one after it."""
        ...

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions, whatever a pass cut short left behind."""
        ...

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` positions, `crop` keeps: any for keys and values,
        the last checkpoint at or before it for a recurrent state."""
        ...

    def save(self) -> Saved | None:
        """A copy of every cached position, in host memory, for `restore` to put back later;
        None where this backend cannot."""
        ...

    def restore(self, saved: Saved) -> None:
        """Make the cache hold exactly what `save` copied."""
        ...

    def reset(self) -> None:
        """Forget everything cached (memory may be kept for reuse)."""
        ...

    @property
    def captures_graphs(self) -> bool:
        """Whether warm_up has a capture or compilation worth paying before the first reply."""
        ...

    def warm_up(self) -> float:
        """Pay one-off costs (graph capture, compilation) now; seconds taken."""
        ...
