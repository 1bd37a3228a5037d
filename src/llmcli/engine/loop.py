"""The hot loop: prefill the prompt in one forward pass, then one token per forward step.

The engine owns the KV cache and the exact token ids it holds (`cached_ids`: prefill, score and
decode_step each extend them as they feed the backend). A call starts from the longest prefix of
its prompt a cached state holds — this cache, or on a server a copy set aside or another slot's
cache (prefix.py decides which) — and prefills only the rest. It never prints: a `Generation`
consumes the token ids a producer (producers.py: plain or speculative) yields, and turns them
into text pieces and a `GenerationResult`; `Engine.complete` gives the result at once.

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
from llmcli.engine import producers
from llmcli.engine.detok import IncrementalDetokenizer, StopMatcher
from llmcli.engine.held import HeldCache
from llmcli.engine.producers import Chooser, TokenLogprob
from llmcli.engine.reasoning import keeps_special_tokens, think_tracker
from llmcli.engine.sampling import make_generator
from llmcli.engine.speculative import Speculation, SpeculativeStats
from llmcli.engine.stats import GenerationStats
from llmcli.errors import ContextOverflowError, NonFiniteLogits

if TYPE_CHECKING:
    from llmcli.engine.backend import Backend
    from llmcli.engine.structured.constraint import Constraint
    from llmcli.models.load import LoadedModel


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # every sampled token, the end-of-sequence token included
    finish_reason: str  # "stop", "length" or "interrupted"
    stats: GenerationStats = field(default_factory=GenerationStats)
    value_complete: bool | None = None  # with a constraint: whether the JSON value was finished
    logprobs: list[TokenLogprob] | None = None  # asked for: one per token in token_ids
    stop_sequence: str | None = None  # the stop string that ended it, if one did


class Engine(HeldCache):
    """The loop's state between calls (held.py: a backend and the exact token ids its KV cache
    holds), with what a call adds: drafts to check (speculation) and text generated."""

    def __init__(self, backend: Backend, eos_token_ids: frozenset[int], context_length: int) -> None:
        super().__init__(backend, eos_token_ids, context_length)
        self.speculation: Speculation | None = None  # drafts checked several tokens per pass

    @classmethod
    def for_loaded(cls, loaded: LoadedModel) -> Engine:
        """The engine a loaded model asked for (--engine, --fast), on the backend that runs it."""
        from llmcli.engine.choose import backend_for

        return cls(backend_for(loaded), loaded.eos_token_ids, loaded.context_length)

    def restore_consistency(self) -> None:
        """After an interrupted call: make the cache (and a draft model's) hold exactly what it says."""
        super().restore_consistency()
        if self.speculation is not None:
            self.speculation.drafter.restore_consistency()

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        constraint: Constraint | None = None,
        think_budget: int | None = None,
        keep_special: bool = False,
        logprobs: int | None = None,
    ) -> Generation:
        """A reply in progress: iterate it for text pieces, then read `result`. A reasoning
        model thinks for `think_budget` tokens at most; a constraint starts when it stops.
        `keep_special`: special tokens stay in the text (a tool call's markers may be some).
        `logprobs`: record each token's log-probability and that many alternatives (no drafts)."""
        if len(prompt_ids) >= self.context_length:
            raise ContextOverflowError(
                f"the prompt is {len(prompt_ids)} tokens; the model's context holds {self.context_length}",
                "shorten the input",
            )
        generation = Generation(self, prompt_ids, params, tokenizer, constraint, think_budget, keep_special)
        generation.logprobs = logprobs
        return generation

    def complete(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any = None,
        constraint: Constraint | None = None,
    ) -> GenerationResult:
        """The whole reply at once, for callers that want a result rather than a stream."""
        generation = self.generate(prompt_ids, params, tokenizer, constraint)
        for _ in generation:
            pass
        return generation.result


class Generation:
    """One call in progress: the text consumer of a token producer. Iterate it for text
    pieces; `result` is valid at any point after. It takes each token the producer yields,
    ends the reply (end of sequence, a stop string, a complete JSON value, the length limit),
    detokenizes and keeps the statistics; what the cache holds is the producer's business."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        constraint: Constraint | None = None,
        think_budget: int | None = None,
        keep_special: bool = False,
    ) -> None:
        self._engine = engine
        # A grammar masks every step's logits; it follows one token at a time, so no drafts.
        self._constraint = constraint
        self._prompt_ids = list(prompt_ids)
        self._params = params
        # No tokenizer (a benchmark on random weights): tokens only, no text.
        # A thinking format of special tokens (harmony) is split from the text: keep them there.
        keep_special = keep_special or keeps_special_tokens(tokenizer)
        self._detok = IncrementalDetokenizer(tokenizer, not keep_special) if tokenizer is not None else None
        self._stop = StopMatcher(params.stop)
        # A reasoning model's thinking, followed only where it matters: a budget, or a constraint
        # that must wait for the answer.
        tracked = think_budget is not None or constraint is not None
        self._thinking = think_tracker(tokenizer, prompt_ids, think_budget) if tracked else None
        self._choose: Chooser | None = None
        self.logprobs: int | None = None  # record log-probabilities, with this many alternatives
        self._emitted: list[str] = []
        self._running: Iterator[str] | None = None
        self._first_token_at = 0.0
        self.token_ids: list[int] = []
        self.finish_reason = "interrupted"  # until the loop says otherwise
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.prefill_logits: torch.Tensor | None = None  # the first step's logits, for exactness checks
        # Room left in the context bounds the reply as much as --max-new-tokens does.
        self._budget = min(params.max_new_tokens, engine.context_length - len(prompt_ids))

    def __iter__(self) -> Iterator[str]:
        self._running = self._run()
        for piece in self._running:
            self._emitted.append(piece)
            yield piece

    def interrupt(self) -> None:
        """Ctrl-C arrived, or the reader left: the producer leaves the cache exact."""
        self.finish_reason = "interrupted"
        if self._running is not None:
            self._running.close()
        self._engine.restore_consistency()

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(
            text="".join(self._emitted),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            value_complete=None if self._constraint is None else self._constraint.complete,
            logprobs=self.recorded_logprobs,
            stop_sequence=self._stop.matched,
        )

    @property
    def recorded_logprobs(self) -> list[TokenLogprob] | None:
        """What was recorded so far (one per token taken), when asked for."""
        if self.logprobs is None:
            return None
        return list(self._choose.recorded[: len(self.token_ids)]) if self._choose else []

    def _run(self) -> Iterator[str]:
        start = time.perf_counter()
        tokens = self._producer(start)
        try:
            for token_id in tokens:
                now = time.perf_counter()
                if not self.token_ids:
                    self.stats.ttft_s = now - start
                    self._first_token_at = now
                piece, ended = self._take(token_id, now)
                if piece:
                    yield piece
                if ended is not None:
                    self.finish_reason = ended
                    break
        finally:
            tokens.close()  # the producer crops the cache to what was taken
            self._engine.prefixes.ended(self._engine)  # kept on disk where that is worth it
        # The end: a character the model left unfinished, and text held back as a possible stop
        # string (a character the length limit cut in its middle is dropped, not shown as U+FFFD).
        rest = self._detok.flush(cut=self.finish_reason == "length") if self._detok else ""
        tail = self._stop.feed(rest)
        if self._stop.stopped:
            self.finish_reason = "stop"
        else:
            tail += self._stop.flush()
        if tail:
            yield tail

    def _producer(self, start: float) -> Iterator[int]:
        """Prefill what the cache does not hold yet, then the producer this call decodes with."""
        engine, params, stats = self._engine, self._params, self.stats
        if params.seed is not None and not params.greedy:
            # A seeded reply must not depend on what the cache holds. Logits from a prompt run in
            # pieces (part cached, the rest now) differ from one run whole: by ~1e-5 in fp32, by
            # up to 0.4 with int4 kernels (the demo), and a draw at T=1 follows the difference.
            # So a seeded call prefills its whole prompt, as a first call does, in-process or
            # through a server: the same seed gives the same text, at the cost of the prefix
            # cache for seeded calls only.
            engine.start_over()
            reused = 0
        else:
            reused = engine.reuse_prefix(self._prompt_ids)
        stats.prefilled_tokens = len(self._prompt_ids) - reused
        stats.cached_from = engine.prefixes.source if reused else None
        logits = engine.prefill(self._prompt_ids[reused:])
        _check_finite(logits)
        self.prefill_logits = logits
        generator = make_generator(params.seed, engine.device) if not params.greedy else None
        choose = Chooser(params, generator, engine.device, list(self._prompt_ids), self._constraint)
        choose.logprobs = self.logprobs
        if self._thinking is not None:
            choose.constrained = self._constraint is not None and not self._thinking.thinking
        self._choose = choose
        # A grammar and log-probabilities follow one token at a time: no drafts.
        speculation = engine.speculation if self._constraint is None and self.logprobs is None else None
        if speculation is not None and not speculation.drafter.free and any(t < 0 for t in self._prompt_ids):
            # A draft model or an MTP head reads the prompt's tokens, and an image is none: this
            # reply decodes plainly, and says so (`speculative` null); a command that asked for
            # both was refused before (frontends/local.py).
            speculation = None
        if speculation is None:
            return producers.plain(engine, logits, choose)
        speculation.drafter.start(self._prompt_ids)
        stats.speculative = SpeculativeStats(speculation.method)
        return producers.speculative(engine, logits, choose, speculation, self._budget, stats.speculative)

    def _follow_thinking(self, text: str) -> None:
        """After each token of a reasoning model: force the end marker at the budget, and let
        the constraint act once the thinking is over."""
        assert self._thinking is not None and self._choose is not None
        forced = self._thinking.take(text)
        if forced:
            self._choose.force(forced)
        self._choose.constrained = self._constraint is not None and not self._thinking.thinking

    def _take(self, token_id: int, now: float) -> tuple[str, str | None]:
        """One token taken: the text it completes, and why the reply ends with it (None: it
        goes on)."""
        stats, constraint = self.stats, self._constraint
        stats.decode_s = now - self._first_token_at
        stats.token_times.append(now)
        self.token_ids.append(token_id)
        stats.completion_tokens = len(self.token_ids)
        text = self._detok.push(token_id) if self._detok else ""
        thinking = self._thinking is not None and self._thinking.thinking
        if constraint is not None and not thinking:
            constraint.advance(token_id)
        if token_id in self._engine.eos_token_ids:
            return "", "stop"
        if self._thinking is not None:
            self._follow_thinking(text)
        piece = self._stop.feed(text)
        if self._stop.stopped or (constraint is not None and not thinking and constraint.finished):
            return piece, "stop"
        if len(self.token_ids) == self._budget:
            return piece, "length"
        return piece, None


def _check_finite(logits: torch.Tensor) -> None:
    """A NaN (or +inf) score of the first step stops the reply: a NaN weight or norm makes every
    score NaN, and greedy decoding then picks token 0 at every step (an empty reply, exit 0)
    while sampling fails inside torch. Once a reply, one reduction over the vocabulary; -inf is a
    score a model may give (a token ruled out)."""
    if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):
        raise NonFiniteLogits(
            "the model computed NaN for the prompt's next token: its weights may be damaged",
            "download them again (llama.cpp's gguf-dump lists a GGUF file's tensors); "
            "a model run in fp16 may overflow where --dtype fp32 does not",
        )
