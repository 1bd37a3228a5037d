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
from llmcli.engine.sampling import NOTHING_SEEN, make_generator, pick_token, process_logits
from llmcli.engine.speculative import Speculation, SpeculativeStats
from llmcli.engine.speculative.acceptance import accept_or_resample
from llmcli.engine.speculative.drafters import Draft
from llmcli.engine.speculative.schedule import agreeing
from llmcli.engine.stats import GenerationStats
from llmcli.errors import ContextOverflowError

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
        self.speculation: Speculation | None = None  # drafts checked several tokens per pass

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
        """After an interrupted call: make the cache (and a draft model's) hold exactly what it says."""
        self.crop_to(len(self.cached_ids))
        if self.speculation is not None:
            self.speculation.drafter.restore_consistency()

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

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        constraint: Constraint | None = None,
    ) -> Generation:
        if len(prompt_ids) >= self.context_length:
            raise ContextOverflowError(
                f"the prompt is {len(prompt_ids)} tokens; the model's context holds {self.context_length}",
                "shorten the input",
            )
        return Generation(self, prompt_ids, params, tokenizer, constraint)


class Generation:
    """One call in progress. Iterate it for text pieces; `result` is valid at any point after."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        constraint: Constraint | None = None,
    ) -> None:
        self._engine = engine
        # A grammar masks every step's logits; it follows one token at a time, so no drafts.
        self._constraint = constraint
        self._prompt_ids = list(prompt_ids)
        self._context = list(prompt_ids)  # the prompt, then every token taken
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
            value_complete=None if self._constraint is None else self._constraint.complete,
        )

    def _run(self) -> Iterator[str]:
        """Rounds of: the model's logits after each token fed → the tokens they choose → print.

        Without speculation a round feeds one token (the last one chosen) through the decode
        step and chooses one. With it, the last token and a draft go through one pass; the
        round chooses every draft token the model agrees with and then the model's own next
        token, and the cache keeps exactly the tokens fed that lie before that last one.
        """
        engine, params, stats = self._engine, self._params, self.stats
        constraint = self._constraint
        speculation = engine.speculation if constraint is None else None
        start = time.perf_counter()
        reused = engine.reuse_prefix(self._prompt_ids)
        stats.prefilled_tokens = len(self._prompt_ids) - reused
        rows = engine.prefill(self._prompt_ids[reused:])
        self.prefill_logits = rows
        generator = make_generator(params.seed, engine.device) if not params.greedy else None
        if speculation is not None:
            speculation.drafter.start(self._prompt_ids)
            stats.speculative = SpeculativeStats(speculation.method)
        round_start = start
        fed: list[int] = []  # the tokens whose logits `rows` holds, past what is cached
        draft = Draft([])  # the drafted tokens among them: all of `fed` but the first
        proposal: list[int] = []  # what the drafter offered this round, checked or not
        first_token_at = start
        while True:
            chosen, last = self._choose(rows, draft, generator)
            now = time.perf_counter()
            if speculation is not None and fed:
                speculation.length.observe_pass(len(fed), now - round_start)
                speculation.length.observe_match(proposal, chosen)
                stats.speculative.drafted += len(draft.tokens)
            finished = False
            taken = 0
            for token_id in chosen:
                if not self.token_ids:
                    first_token_at = now
                    stats.ttft_s = now - start
                stats.decode_s = now - first_token_at
                stats.token_times.append(now)
                self.token_ids.append(token_id)
                self._context.append(token_id)
                stats.completion_tokens = len(self.token_ids)
                taken += 1
                if constraint is not None:
                    constraint.advance(token_id)
                if token_id in engine.eos_token_ids:
                    self.finish_reason, finished = "stop", True
                    break
                piece = self._stop.feed(self._detok.push(token_id) if self._detok else "")
                if piece:
                    yield piece
                if self._stop.stopped or (constraint is not None and constraint.finished):
                    self.finish_reason, finished = "stop", True
                    break
                if len(self.token_ids) == self._budget:
                    self.finish_reason, finished = "length", True
                    break
            if speculation is not None and fed:
                stats.speculative.accepted += min(taken, len(chosen) - 1)
            # The cache keeps the fed tokens before the last one taken: everything the next
            # token's logits depend on, and nothing past it.
            engine.cached_ids.extend(fed[:taken])
            if engine.backend.length != len(engine.cached_ids):
                engine.backend.crop(len(engine.cached_ids))
            if finished:
                break
            token_id = self.token_ids[-1]
            proposal, draft = [], Draft([])
            if speculation is not None:
                proposal, draft = self._draft(speculation, generator)
            round_start = time.perf_counter()
            fed = [token_id, *draft.tokens]
            if draft.tokens:
                rows = engine.backend.score(fed)
            else:
                rows = engine.decode_step(last if last is not None else self._on_device(token_id))
        # The end: a character the model left unfinished, and text held back as a possible stop string.
        tail = self._stop.feed(self._detok.flush() if self._detok else "")
        if self._stop.stopped:
            self.finish_reason = "stop"
        else:
            tail += self._stop.flush()
        if tail:
            yield tail

    def _choose(
        self, rows: torch.Tensor, draft: Draft, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """The tokens `rows` choose: every drafted token the model agrees with, then its own next
        one. Without a draft, also that token as a device tensor: the next decode step's input."""
        params, drafted = self._params, draft.tokens
        if not drafted:
            if self._constraint is not None:
                rows = self._constraint.mask(rows)  # before every sampling filter
            token = pick_token(process_logits(rows, self._seen([]), params), params, generator)
            return [int(token)], token  # the one host sync per token: we need the id to print it
        if params.greedy and params.repetition_penalty == 1.0:
            best = rows.argmax(dim=-1).tolist()  # one host sync for the whole run
            return best[: agreeing(best, drafted) + 1], None
        chosen: list[int] = []
        for i in range(rows.shape[0]):
            logits = process_logits(rows[i : i + 1], self._seen(chosen), params)
            if i < len(drafted) and not params.greedy:
                probs = logits.float().softmax(dim=-1)[0]
                draft_probs = None if draft.probs is None else _fit(draft.probs[i], probs.shape[0])
                token = accept_or_resample(probs, drafted[i], draft_probs, generator)
            else:
                token = int(pick_token(logits, params, generator))
            chosen.append(token)
            if i == len(drafted) or token != drafted[i]:
                break
        return chosen, None

    def _draft(self, speculation: Speculation, generator: torch.Generator | None) -> tuple[list[int], Draft]:
        """This round's proposal (to measure how drafts match) and the part of it to check."""
        length, drafter = speculation.length, speculation.drafter
        # Room for the drafted tokens and the model's own token after them.
        available = self._budget - len(self.token_ids) - 1
        if drafter.free:
            # A lookup costs nothing: offer all of it, and measure it even when none is checked.
            proposal = drafter.propose(self._context, available, self._params, generator).tokens
            return proposal, Draft(proposal[: length.next(len(proposal))])
        draft = drafter.propose(self._context, length.next(available, probing=True), self._params, generator)
        length.observe_drafting(len(draft.tokens), draft.seconds)
        return draft.tokens, draft

    def _seen(self, chosen: list[int]) -> torch.Tensor:
        """The tokens the repetition penalty looks at: the prompt, the reply, and `chosen` after it."""
        if self._params.repetition_penalty == 1.0:
            return NOTHING_SEEN
        return torch.tensor([self._context + chosen], dtype=torch.long, device=self._engine.device)

    def _on_device(self, token_id: int) -> torch.Tensor:
        return torch.tensor([token_id], dtype=torch.long, device=self._engine.device)


def _fit(probs: torch.Tensor, size: int) -> torch.Tensor:
    """A draft model's distribution over the model's vocabulary size (either may be padded)."""
    if probs.shape[0] == size:
        return probs
    fitted = probs.new_zeros(size)
    common = min(size, probs.shape[0])
    fitted[:common] = probs[:common]
    return fitted
