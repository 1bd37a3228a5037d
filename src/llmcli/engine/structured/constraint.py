"""One generation's grammar state: which tokens may come next, and whether the value is done."""

from __future__ import annotations

from typing import Any

import torch

from llmcli.engine.structured import OutputFormat
from llmcli.engine.structured.grammar import check_format, guidance_tokenizer
from llmcli.errors import LlmcliError

_BITS = torch.tensor([1 << bit for bit in range(31)] + [-(1 << 31)], dtype=torch.int32)


class Constraint:
    """Masks logits to what the grammar allows, follows the tokens chosen, says when the value
    is complete. The mask is computed on the CPU (llguidance) into a bitmask of 32 tokens per
    int32 and unpacked on the logits' device."""

    def __init__(self, output: OutputFormat, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]):
        from llguidance import LLMatcher

        # llguidance's numpy helpers: its torch ones import torch.compile machinery (~3 s).
        from llguidance.numpy import allocate_token_bitmask

        self.output = output
        self._vocab_size = vocab_size
        self._matcher = LLMatcher(
            guidance_tokenizer(tokenizer, vocab_size, eos_token_ids), check_format(output), log_level=0
        )
        if self._matcher.is_error():
            raise LlmcliError(f"{output.label}: {self._matcher.get_error()}")
        self._words = allocate_token_bitmask(1, vocab_size)  # int32 words, 32 tokens each
        self._bitmask = torch.from_numpy(self._words)  # the same memory, as a tensor
        self._bits: dict[torch.device, torch.Tensor] = {}

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [1, V] with every token the grammar forbids at −inf."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._words)
        device = logits.device
        bitmask = self._bitmask.to(device, non_blocking=True)
        bits = self._bits.get(device)
        if bits is None:
            bits = self._bits[device] = _BITS.to(device)
        # The bitmask covers the model's vocabulary (rounded up to 32): cut it to the logits.
        allowed = (bitmask.unsqueeze(-1) & bits).ne(0).view(1, -1)[:, : logits.shape[-1]]
        return logits.masked_fill(allowed.logical_not_(), float("-inf"))

    def advance(self, token_id: int) -> None:
        """The token the loop chose (one the mask allowed)."""
        if not self._matcher.consume_token(token_id):
            error = self._matcher.get_error()
            raise LlmcliError(f"{self.output.label}: the grammar refused a token ({error})")

    @property
    def finished(self) -> bool:
        """No token but end-of-sequence can follow: the value is complete."""
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """What was generated is a whole valid value (it could end here)."""
        matcher = self._matcher
        return not matcher.is_error() and (matcher.is_accepting() or matcher.is_stopped())
