"""The hot loop: prefill the prompt in one forward pass, then one token per forward step.

The engine owns the KV cache and the exact token ids it holds (`cached_ids`), so a later call
whose prompt starts with those ids prefills only the rest. It never prints: a `Generation` yields
text pieces and ends with a `GenerationResult`.

Which backend runs the forward pass (llmcli's native one, or transformers) is settled when the
engine is made; the loop never asks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.detok import IncrementalDetokenizer, StopMatcher
from llmcli.engine.sampling import make_generator, pick_token, process_logits
from llmcli.engine.stats import GenerationStats
from llmcli.errors import ContextOverflowError

if TYPE_CHECKING:
    from llmcli.engine.backend import Backend
    from llmcli.models.load import LoadedModel


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # every sampled token, the end-of-sequence token included
    finish_reason: str  # "stop", "length" or "interrupted"
    stats: GenerationStats = field(default_factory=GenerationStats)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """The loop's state between calls: a backend and the exact token ids its KV cache holds."""

    def __init__(self, backend: Backend, eos_token_ids: frozenset[int], context_length: int) -> None:
        self.backend = backend
        self.device = backend.device
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.cached_ids: list[int] = []  # exactly the tokens whose keys/values the backend holds

    @classmethod
    def for_loaded(cls, loaded: LoadedModel) -> Engine:
        """The engine a loaded model asked for (--engine, --fast), on the backend that runs it."""
        from llmcli.engine.choose import backend_for

        return cls(backend_for(loaded), loaded.eos_token_ids, loaded.context_length)

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
        """Forget cached tokens past the first `keep`."""
        del self.cached_ids[keep:]
        self.backend.crop(keep)

    def restore_consistency(self) -> None:
        """After an interrupted call: make the cache hold exactly `cached_ids` again."""
        self.crop_to(len(self.cached_ids))

    def free_memory(self) -> None:
        """Hand the allocator's cached blocks back after an out-of-memory error."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reuse_prefix(self, ids: list[int]) -> int:
        """Crop the cache to its longest common prefix with `ids`; return how many tokens it keeps.

        At least one token of `ids` is left to run, since the next token's logits come from it.
        """
        return self._keep_common_prefix(ids, at_most=len(ids) - 1)

    def _keep_common_prefix(self, ids: list[int], at_most: int) -> int:
        keep = min(common_prefix_length(self.cached_ids, ids), at_most)
        self.crop_to(keep)
        return keep

    def warm(self, ids: list[int]) -> int:
        """Bring the cache to hold `ids` (a loaded chat), prefilling only what is not cached yet.
        Returns the number of tokens prefilled."""
        keep = self._keep_common_prefix(ids, at_most=len(ids))
        if keep < len(ids):
            self.prefill(ids[keep:])
        return len(ids) - keep

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after what is cached, in one pass; the logits for the next token, [1, vocab]."""
        logits = self.backend.prefill(ids)
        self.cached_ids.extend(ids)
        return logits

    def decode_step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one sampled token (shape [1]); the logits for the one after it, [1, vocab]."""
        return self.backend.decode(token)

    def generate(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Any) -> Generation:
        if len(prompt_ids) >= self.context_length:
            raise ContextOverflowError(
                f"the prompt is {len(prompt_ids)} tokens; the model's context holds {self.context_length}",
                "shorten the input",
            )
        return Generation(self, prompt_ids, params, tokenizer)


class Generation:
    """One call in progress. Iterate it for text pieces; `result` is valid at any point after."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, tokenizer: Any) -> None:
        self._engine = engine
        self._prompt_ids = list(prompt_ids)
        self._params = params
        # No tokenizer (a benchmark on random weights): tokens only, no text.
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopMatcher(params.stop)
        self._emitted: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason = "interrupted"  # until the loop says otherwise
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.prefill_logits: torch.Tensor | None = None  # the first step's logits, for exactness checks
        # Room left in the context bounds the reply as much as --max-new-tokens does.
        self._budget = min(params.max_new_tokens, engine.context_length - len(prompt_ids))

    def __iter__(self) -> Iterator[str]:
        for piece in self._run():
            self._emitted.append(piece)
            yield piece

    def interrupt(self) -> None:
        """Ctrl-C arrived: whatever the loop was doing, the cache must match `cached_ids` again."""
        self.finish_reason = "interrupted"
        self._engine.restore_consistency()

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(
            text="".join(self._emitted),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
        )

    def _run(self) -> Iterator[str]:
        engine, params, stats = self._engine, self._params, self.stats
        start = time.perf_counter()
        reused = engine.reuse_prefix(self._prompt_ids)
        stats.prefilled_tokens = len(self._prompt_ids) - reused
        logits = engine.prefill(self._prompt_ids[reused:])
        self.prefill_logits = logits
        generator = make_generator(params.seed, engine.device) if not params.greedy else None
        seen = torch.tensor([self._prompt_ids], dtype=torch.long, device=engine.device)
        first_token_at = start
        for step in range(self._budget):
            token = pick_token(process_logits(logits, seen, params), params, generator)
            token_id = int(token)  # the one host sync per token: we need the id to print it
            now = time.perf_counter()
            if step == 0:
                first_token_at = now
                stats.ttft_s = now - start
            stats.decode_s = now - first_token_at
            stats.token_times.append(now)
            self.token_ids.append(token_id)
            stats.completion_tokens = len(self.token_ids)
            if token_id in engine.eos_token_ids:
                self.finish_reason = "stop"
                break
            piece = self._stop.feed(self._detok.push(token_id) if self._detok else "")
            if piece:
                yield piece
            if self._stop.stopped:
                self.finish_reason = "stop"
                return
            if step + 1 == self._budget:
                self.finish_reason = "length"
                break
            if params.repetition_penalty != 1.0:
                seen = torch.cat([seen, token.view(1, 1)], dim=1)
            logits = engine.decode_step(token)
            engine.cached_ids.append(token_id)
        # The end: a character the model left unfinished, and text held back as a possible stop string.
        tail = self._stop.feed(self._detok.flush() if self._detok else "")
        if self._stop.stopped:
            self.finish_reason = "stop"
        else:
            tail += self._stop.flush()
        if tail:
            yield tail
