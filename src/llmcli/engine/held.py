"""A backend and exactly the token ids its KV cache holds: every pass that feeds it (prefill,
score, a decode step) and every crop keep the two equal, and where a prompt starts is asked of the
prefix store (prefix.py). Token producers (producers.py) and a draft model drive one of these;
loop.Engine adds what a call needs on top (speculation, text), so they need not import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmcli.engine.prefix import PrefixStore

if TYPE_CHECKING:
    from llmcli.engine.backend import Backend


class HeldCache:
    """A backend and exactly the token ids its KV cache holds."""

    def __init__(self, backend: Backend, eos_token_ids: frozenset[int], context_length: int) -> None:
        self.backend = backend
        self.device = backend.device
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.cached_ids: list[int] = []  # exactly the tokens whose keys/values the backend holds
        # Which cached state a prompt starts from (prefix.py). This one keeps no host copies and
        # knows no other slot: a new prompt crops the cache (generate, chat, a draft model). A
        # server's slots share one with a budget for copies.
        self.prefixes = PrefixStore()

    @property
    def name(self) -> str:
        return self.backend.name

    def reset(self) -> None:
        """Forget everything cached."""
        self.backend.reset()
        self.cached_ids = []

    def warm_up(self) -> float:
        """Pay graph capture (or compilation) now rather than in the first reply; seconds taken."""
        seconds = self.backend.warm_up()
        self.cached_ids = []
        return seconds

    def crop_to(self, keep: int) -> None:
        """Forget cached tokens past the first `keep` (or more: a sliding window's ring cropped
        further back than it can restore keeps nothing, and what was cropped is run again)."""
        self.backend.crop(keep)
        del self.cached_ids[min(keep, self.backend.length) :]

    def restore_consistency(self) -> None:
        """After an interrupted call: make the cache hold exactly what `cached_ids` says."""
        self.crop_to(len(self.cached_ids))

    def free_memory(self) -> None:
        """Hand the allocator's cached blocks back after an out-of-memory error."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reuse_prefix(self, ids: list[int]) -> int:
        """Start `ids` from the longest prefix a cached state holds (this cache's, a host copy's,
        another slot's: prefix.py); return how many tokens the cache holds of it.

        At least one token of `ids` is left to run, since the next token's logits come from it.
        """
        return self.prefixes.start(self, ids, at_most=len(ids) - 1)

    def start_over(self) -> None:
        """Empty the cache for a prompt that must run whole (a seeded draw, a prompt scored)."""
        self.prefixes.start_over(self)

    def keep_prefix_of(self, ids: list[int]) -> int:
        """Hold the longest prefix of `ids` a cached state gives, nothing past it (chat /undo:
        the cache cropped back to the conversation); how many tokens it holds."""
        return self.prefixes.start(self, ids, at_most=len(ids))

    def warm(self, ids: list[int]) -> int:
        """Bring the cache to hold `ids` (a loaded chat), prefilling only what is not cached yet.
        Returns the number of tokens prefilled."""
        keep = self.keep_prefix_of(ids)
        if keep < len(ids):
            self.prefill(ids[keep:])
        return len(ids) - keep

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after what is cached, in one pass; the logits for the next token, [1, vocab]."""
        logits = self.backend.prefill(ids)
        self.cached_ids.extend(ids)
        return logits

    def score(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after what is cached, in one pass; the logits after each, [len(ids), vocab]."""
        rows = self.backend.score(ids)
        self.cached_ids.extend(ids)
        return rows

    def decode_step(self, token_id: int, token: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token (its id, and the same as a [1] device tensor when the caller has it:
        no copy to the device then); the logits for the one after it, [1, vocab]."""
        if token is None:
            token = torch.tensor([token_id], dtype=torch.long, device=self.device)
        logits = self.backend.decode(token)
        self.cached_ids.append(token_id)
        return logits
