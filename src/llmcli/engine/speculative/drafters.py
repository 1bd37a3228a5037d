"""Where drafted tokens come from: the text itself (prompt lookup) or a smaller model."""

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


@dataclass
class Draft:
    tokens: list[int]
    # The draft model's distribution each token was drawn from, [len(tokens), vocab], when it
    # sampled; None for greedy drafts and lookups (a point mass is all the rule needs then).
    probs: torch.Tensor | None = None
    seconds: float = 0.0  # what drafting cost


class Drafter(Protocol):
    method: str  # "lookup" or "draft", as --json and /stats report it
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
                    return Draft(context[after : after + limit])
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
        with_penalty = params.needs_history
        for i in range(limit):
            seen = torch.tensor([context + tokens], device=engine.device) if with_penalty else NOTHING_SEEN
            processed = process_logits(logits, seen, params)
            if params.greedy:
                token = processed.argmax(dim=-1)
            else:
                distribution = processed.float().softmax(dim=-1)
                token = torch.multinomial(distribution, num_samples=1, generator=generator).view(1)
                probs.append(distribution[0])
            token_id = int(token)
            tokens.append(token_id)
            if i + 1 == limit or token_id in engine.eos_token_ids:
                break  # the last drafted token is not fed: the model's pass feeds it
            logits = engine.decode_step(token_id, token.view(1))
        return Draft(tokens, torch.stack(probs) if probs else None, time.perf_counter() - started)

    def restore_consistency(self) -> None:
        self.engine.restore_consistency()


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
