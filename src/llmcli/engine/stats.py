"""Timings of one generation call, measured with a monotonic clock, never estimated."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmcli.engine.speculative import SpeculativeStats


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens of the prompt, cached or not
    prefilled_tokens: int = 0  # tokens actually run through the model in the prefill pass
    completion_tokens: int = 0  # tokens sampled, the end-of-sequence token included
    ttft_s: float = 0.0  # request start → first token sampled (prefill + first sample)
    decode_s: float = 0.0  # first token → last token
    token_times: list[float] = field(default_factory=list, repr=False)  # perf_counter at each token
    speculative: SpeculativeStats | None = None  # drafted and accepted tokens, when speculating
    cached_from: str | None = None  # where the cached tokens came from (prefix.PrefixStore.source)

    @property
    def inter_token_s(self) -> list[float]:
        """Seconds between consecutive tokens: the latency a reader sees while text streams."""
        times = self.token_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.prefilled_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, over the time they took: the steady decode rate."""
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0
