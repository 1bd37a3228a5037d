"""Where drafted tokens come from: the text itself (prompt lookup), a smaller model, or the
model's own multi-token-prediction module (Qwen3.5's MTP head)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llmcli.engine.sampling import NOTHING_SEEN, process_logits
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.config.settings import SamplingParams
    from llmcli.engine.held import HeldCache
    from llmcli.engine.native.mtp import MtpHead
    from llmcli.engine.native.plans import Plan


@dataclass
class Draft:
    tokens: list[int]
    # The draft model's distribution each token was drawn from, [len(tokens), vocab], when it
    # sampled; None for greedy drafts and lookups (a point mass is all the rule needs then).
    probs: torch.Tensor | None = None
    seconds: float = 0.0  # what drafting cost


class Drafter(Protocol):
    method: str  # "lookup", "draft" or "mtp", as --json and /stats report it
    free: bool  # drafting costs nothing worth measuring (a lookup), so offer all there is

    def start(self, prompt: list[int]) -> None:
        """A new generation begins after `prompt`."""
        ...

    def propose(
        self, context: list[int], limit: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """At most `limit` tokens to follow `context` (the prompt and every token chosen since)."""
        ...

    def restore_consistency(self) -> None:
        """After an interrupted call: whatever the drafter caches is consistent again."""
        ...


class LookupDrafter:
    """Prompt lookup: find the last n tokens earlier in the context and draft what followed them.

    Longer n-grams first (a 4-token match predicts better than a 2-token one) and, for each n,
    the latest occurrence. The index maps each n-gram to the position after its latest
    occurrence and grows by a few dictionary writes per token.
    """

    method = "lookup"
    free = True

    def __init__(self, longest: int = 4, shortest: int = 2) -> None:
        self.sizes = range(longest, shortest - 1, -1)
        self._after: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0

    def start(self, prompt: list[int]) -> None:
        self._after = {n: {} for n in self.sizes}
        self._indexed = 0

    def propose(
        self, context: list[int], limit: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        self._index(context)
        if limit <= 0:
            return Draft([])
        for n in self.sizes:
            if len(context) > n:
                after = self._after[n].get(tuple(context[-n:]))
                if after is not None:
                    drafted = context[after : after + limit]
                    # Up to an image's marker: an image is not a token to sample (image_markers.py).
                    cut = next((i for i, token in enumerate(drafted) if token < 0), len(drafted))
                    return Draft(drafted[:cut])
        return Draft([])

    def _index(self, context: list[int]) -> None:
        # Position j is indexed once context[j] is known: the n-gram ending just before it
        # then has a continuation. The context's own last n-gram never matches itself.
        for j in range(self._indexed, len(context)):
            for n in self.sizes:
                if j >= n:
                    self._after[n][tuple(context[j - n : j])] = j
        self._indexed = len(context)

    def restore_consistency(self) -> None:
        pass  # the index is rebuilt from the prompt at the next start()


class ModelDrafter:
    """A smaller model with the same vocabulary drafts, decoding on its own engine and cache.

    Its cache persists like the model's: each round prefills only the tokens the model chose
    since the last one (the draft's rejected tokens are cropped by the common-prefix rule).
    """

    method = "draft"
    free = False

    def __init__(self, engine: HeldCache, name: str) -> None:
        self.engine = engine
        self.name = name

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(
        self, context: list[int], limit: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        engine = self.engine
        limit = min(limit, engine.context_length - len(context))
        if limit <= 0:
            return Draft([])
        started = time.perf_counter()
        keep = engine.reuse_prefix(context)
        logits = engine.prefill(context[keep:])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(limit):
            token = _draw(logits, context + tokens, params, generator, probs)
            token_id = int(token)
            tokens.append(token_id)
            if i + 1 == limit or token_id in engine.eos_token_ids:
                break  # the last drafted token is not fed: the model's pass feeds it
            logits = engine.decode_step(token_id, token.view(1))
        return Draft(tokens, torch.stack(probs) if probs else None, time.perf_counter() - started)

    def restore_consistency(self) -> None:
        self.engine.restore_consistency()


def _draw(
    logits: torch.Tensor,
    seen: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    probs: list[torch.Tensor],
) -> torch.Tensor:
    """A drafted token [1] from `logits` [1, vocab] under the call's sampling rule (`seen`: the
    tokens before it, for a repetition penalty): the best one, or one drawn, its distribution
    appended to `probs` for the acceptance rule."""
    history = torch.tensor([seen], device=logits.device) if params.needs_history else NOTHING_SEEN
    processed = process_logits(logits, history, params)
    if params.greedy:
        return processed.argmax(dim=-1)
    distribution = processed.float().softmax(dim=-1)
    probs.append(distribution[0])
    return torch.multinomial(distribution, num_samples=1, generator=generator).view(1)


class MtpDrafter:
    """The model's own MTP module drafts (engine/native/mtp.py says what it computes).

    Its one layer keeps a KV cache over the sequence, as the model's own: every pass of the
    model hands over its rows' final-norm outputs (`Transformer.hidden_tap`), and each round
    first runs the MTP module over the positions the model has settled since the last (the
    accepted rows of the check, or a prompt's), then chains `limit` drafts from the last. The
    entries of a position whose tokens changed since (a new turn, a rejected draft) are cropped;
    where the model's rows for some positions never came (a prefix restored from a copy), the
    module starts over from the longest run of rows it has, ending at the last position.
    """

    method = "mtp"
    free = False

    def __init__(self, engine: HeldCache, head: MtpHead) -> None:
        self.engine, self.head = engine, head
        self._cache = engine.backend.cache  # type: ignore[attr-defined]  # whose passes are ours
        self._passes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (positions, rows) not read yet
        self._held_rows = 0
        self._hidden: dict[int, torch.Tensor] = {}  # main position → its final-norm output
        # Entry j of the head's cache is position offset + j; the entries hold for as long as
        # the tokens they read (`_read`: up to the one after the last entry's position) stand.
        self._offset = 0
        self._read: list[int] = []
        engine.backend.net.hidden_tap = self._record  # type: ignore[attr-defined]

    def _record(self, plan: Plan, rows: torch.Tensor) -> None:
        if getattr(plan, "cache", None) is not self._cache:
            return  # another sequence's pass over the same weights
        self._passes.append((plan.positions, rows))
        self._held_rows += rows.shape[0]
        # Rounds without drafting (speculation turned off) read nothing: at most a context's
        # worth of rows is kept, the oldest dropped (the head then starts over, later).
        while self._held_rows > self.engine.context_length and len(self._passes) > 1:
            self._held_rows -= self._passes.pop(0)[1].shape[0]

    def start(self, prompt: list[int]) -> None:
        pass  # the head's entries are kept where the new prompt's tokens agree with them

    def propose(
        self, context: list[int], limit: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        engine, head = self.engine, self.head
        self._take_passes()
        held = len(engine.cached_ids)  # positions the model has run; context[held] comes next
        limit = min(limit, engine.context_length - len(context))
        start = self._first_to_run(context, held)
        if limit <= 0 or start is None:
            return Draft([])
        started = time.perf_counter()
        device = engine.device
        hidden = torch.stack([self._hidden[position] for position in range(start, held)])
        out, logits = head.run(torch.tensor(context[start + 1 : held + 1], device=device), hidden)
        self._read = context[: held + 1]
        for position in [p for p in self._hidden if p < held - 1]:  # the last one may run again
            del self._hidden[position]
        settled = head.cache.length
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        try:
            for i in range(limit):
                token = _draw(logits, context + tokens, params, generator, probs)
                tokens.append(int(token))
                if i + 1 == limit or tokens[-1] in engine.eos_token_ids:
                    break
                out, logits = head.run(token.view(1), out[-1:])
        finally:
            head.cache.crop(settled)  # chained entries read the head's own output: guesses
        return Draft(tokens, torch.stack(probs) if probs else None, time.perf_counter() - started)

    def _take_passes(self) -> None:
        for positions, rows in self._passes:
            first = int(positions[0])
            for i in range(rows.shape[0]):
                self._hidden[first + i] = rows[i]
        self._passes, self._held_rows = [], 0

    def _first_to_run(self, context: list[int], held: int) -> int | None:
        """The first position the head runs this round (its entries before it kept), or None
        where the model's row at the last position is missing."""
        agreed = 0
        for ours, theirs in zip(self._read, context, strict=False):
            if ours != theirs:
                break
            agreed += 1
        # An entry at position p read the tokens up to p + 1; the last position runs again
        # whenever there is nothing after it to run (its logits draft the first token).
        kept = max(0, min(self.head.cache.length, agreed - 1 - self._offset, held - 1 - self._offset))
        first = self._offset + kept
        rows_from = held  # the longest run of the model's rows that ends at the last position
        while rows_from - 1 in self._hidden:
            rows_from -= 1
        if rows_from == held:
            return None
        if first < held and rows_from <= first:
            self.head.cache.crop(kept)
            return first
        self.head.cache.crop(0)  # a gap before the rows: the head starts over after it
        self._offset = rows_from
        return rows_from

    def restore_consistency(self) -> None:
        self.head.cache.crop(max(0, min(self.head.cache.length, len(self._read) - 1 - self._offset)))


def check_same_vocabulary(tokenizer: Any, draft_tokenizer: Any, draft_name: str) -> None:
    """A draft model must spell every token with the same id: refuse in one line, naming how not."""
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours == theirs:
        return
    if len(ours) != len(theirs):
        raise UsageError(
            f"draft model {draft_name} has a vocabulary of {len(theirs)} tokens, the model {len(ours)}: "
            "it needs the model's own tokenizer",
            "pick a draft model of the same family (or --speculative lookup)",
        )
    token = next(t for t in sorted(ours, key=ours.__getitem__) if theirs.get(t) != ours[t])
    raise UsageError(
        f"draft model {draft_name} numbers its tokens differently: {token!r} is {theirs.get(token)} there, "
        f"{ours[token]} in the model",
        "pick a draft model of the same family (or --speculative lookup)",
    )
