"""Token producers: generators of token ids, after a prefill, for the loop to consume.

`plain` feeds each token it yields through one decode step; `speculative` checks a draft and
the last token in one pass and yields every draft token the model agrees with, then its own.
Both keep one promise, in a `finally`: whenever the consumer stops taking tokens (end of
sequence, a stop string, the length limit, Ctrl-C, a reader gone), the engine's cache holds
exactly the tokens before the last one yielded, and the ids it says it holds. The consumer
never crops, rewinds or counts what is cached.

How a token is chosen from logits (the sampling rule, a grammar's mask, the speculative
acceptance rule) is the `Chooser`'s business; a producer decides only which logits to compute.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmcli.engine.sampling import NOTHING_SEEN, pick_token, process_logits
from llmcli.engine.speculative.acceptance import accept_or_resample
from llmcli.engine.speculative.drafters import Draft
from llmcli.engine.speculative.schedule import agreeing

if TYPE_CHECKING:
    from llmcli.config.settings import SamplingParams
    from llmcli.engine.held import HeldCache
    from llmcli.engine.speculative import Speculation, SpeculativeStats
    from llmcli.engine.structured.constraint import Constraint


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at that step, best first


class Chooser:
    """Logits → tokens under one call's sampling values: the repetition penalty looks at
    `context` (the prompt and every token taken since, kept by the producer), a grammar masks
    the logits before every filter, and drafted tokens pass the speculative acceptance rule."""

    def __init__(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        device: torch.device,
        context: list[int],
        constraint: Constraint | None = None,
    ) -> None:
        self.params = params
        self.generator = generator
        self.device = device
        self.context = context
        self.constraint = constraint
        self.constrained = constraint is not None  # off while a reasoning model thinks
        self.forced: list[int] = []  # tokens to take next whatever the logits say
        # With `logprobs` (the most likely alternatives to report, 0: none), each chosen token's
        # log-probability under the model's own logits, and its alternatives', as vLLM defines
        # them: log-softmax before any sampling rule or grammar.
        self.logprobs: int | None = None
        self.recorded: list[TokenLogprob] = []

    def force(self, token_ids: list[int]) -> None:
        """Take these tokens next (a thinking budget's end marker), before sampling again."""
        self.forced.extend(token_ids)

    def one(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The next token, as an id and as a device tensor (the next decode step's input)."""
        raw = logits
        if self.forced:
            token_id = self.forced.pop(0)
            self._record(raw, token_id)
            return token_id, torch.tensor([token_id], dtype=torch.long, device=self.device)
        if self.constraint is not None and self.constrained:
            logits = self.constraint.mask(logits)  # before every sampling filter
        token = pick_token(process_logits(logits, self.seen([]), self.params), self.params, self.generator)
        token_id = int(token)  # the one host sync per token: the id is printed
        self._record(raw, token_id)
        return token_id, token

    def _record(self, logits: torch.Tensor, token_id: int) -> None:
        if self.logprobs is None:
            return
        row = logits[0].float().log_softmax(dim=-1)
        top = row.topk(self.logprobs) if self.logprobs else None
        alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
        self.recorded.append(TokenLogprob(token_id, float(row[token_id]), alternatives))

    def run(self, rows: torch.Tensor, draft: Draft) -> list[int]:
        """The tokens `rows` [len(draft) + 1, vocab] choose: every drafted token the model
        agrees with, then its own next one."""
        params, drafted = self.params, draft.tokens
        if params.plain_greedy:
            best = rows.argmax(dim=-1).tolist()  # one host sync for the whole run
            return best[: agreeing(best, drafted) + 1]
        chosen: list[int] = []
        for i in range(rows.shape[0]):
            logits = process_logits(rows[i : i + 1], self.seen(chosen), params)
            if i < len(drafted) and not params.greedy:
                probs = logits.float().softmax(dim=-1)[0]
                draft_probs = None if draft.probs is None else _fit(draft.probs[i], probs.shape[0])
                token = accept_or_resample(probs, drafted[i], draft_probs, self.generator)
            else:
                token = int(pick_token(logits, params, self.generator))
            chosen.append(token)
            if i == len(drafted) or token != drafted[i]:
                break
        return chosen

    def seen(self, chosen: list[int]) -> torch.Tensor:
        """The tokens the repetition penalty looks at: the context, and `chosen` after it."""
        if not self.params.needs_history:
            return NOTHING_SEEN
        return torch.tensor([self.context + chosen], dtype=torch.long, device=self.device)


def plain(engine: HeldCache, logits: torch.Tensor, choose: Chooser) -> Iterator[int]:
    """One token per decode step. A token is fed only once the consumer asks for the next one."""
    try:
        while True:
            token_id, token = choose.one(logits)
            choose.context.append(token_id)
            yield token_id
            logits = engine.decode_step(token_id, token)
    finally:
        engine.restore_consistency()  # a step cut short (Ctrl-C) leaves nothing half-written


def speculative(
    engine: HeldCache,
    logits: torch.Tensor,
    choose: Chooser,
    speculation: Speculation,
    budget: int,
    stats: SpeculativeStats,
) -> Iterator[int]:
    """Rounds of: the last token and a draft through one pass → the tokens the model agrees
    with, then its own. `budget`: tokens the consumer may take at most (drafts past it are
    waste). The first round has no draft: `logits` is the prefill's last row."""
    length, drafter = speculation.length, speculation.drafter
    # A backend that pads its passes (the native one's graphs) says what each size really runs.
    length.pass_rows = getattr(engine.backend, "pass_rows", length.pass_rows)
    base = len(engine.cached_ids)  # what the cache holds for sure
    keep = base  # what it must hold if the consumer stops now
    rows, fed, draft, proposal = logits, [], Draft([]), []
    taken = 0
    round_start = time.perf_counter()
    try:
        while True:
            last = None  # without a draft: the chosen token on the device, the decode step's input
            if draft.tokens:
                chosen = choose.run(rows, draft)
            else:
                token_id, last = choose.one(rows)
                chosen = [token_id]
            if fed:
                length.observe_pass(len(fed), time.perf_counter() - round_start)
                length.observe_match(proposal, chosen)
                stats.drafted += len(draft.tokens)
            for i, token_id in enumerate(chosen):
                # Everything this token's logits depend on, and nothing past it.
                keep = base + min(i + 1, len(fed))
                if i < len(chosen) - 1:
                    stats.accepted += 1  # a drafted token, agreed with
                choose.context.append(token_id)
                taken += 1
                yield token_id
            if len(engine.cached_ids) != keep:
                engine.crop_to(keep)  # the rejected drafts
                if len(engine.cached_ids) < keep:
                    # A cache that cannot go back (a recurrent state, a full sliding window)
                    # was emptied instead: run again what it must hold, or the next pass would
                    # start at position 0.
                    engine.prefill(choose.context[len(engine.cached_ids) : keep])
            base = keep
            proposal, draft = _draft(speculation, choose, budget - taken - 1)
            round_start = time.perf_counter()
            fed = [chosen[-1], *draft.tokens]
            rows = engine.score(fed) if draft.tokens else engine.decode_step(chosen[-1], last)
    finally:
        engine.crop_to(min(keep, len(engine.cached_ids)))
        drafter.restore_consistency()


def _draft(speculation: Speculation, choose: Chooser, available: int) -> tuple[list[int], Draft]:
    """This round's proposal (to measure how drafts match) and the part of it to check.
    `available`: room for drafted tokens before the budget (the model's own token comes after)."""
    length, drafter = speculation.length, speculation.drafter
    if drafter.free:
        # A lookup costs nothing: offer all of it, and measure it even when none is checked.
        proposal = drafter.propose(choose.context, available, choose.params, choose.generator).tokens
        return proposal, Draft(proposal[: length.next(len(proposal))])
    draft = drafter.propose(
        choose.context, length.next(available, probing=True), choose.params, choose.generator
    )
    length.observe_drafting(len(draft.tokens), draft.seconds)
    return draft.tokens, draft


def _fit(probs: torch.Tensor, size: int) -> torch.Tensor:
    """A draft model's distribution over the model's vocabulary size (either may be padded)."""
    if probs.shape[0] == size:
        return probs
    fitted = probs.new_zeros(size)
    common = min(size, probs.shape[0])
    fitted[:common] = probs[:common]
    return fitted
