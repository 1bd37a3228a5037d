"""Several prompts at once: left padding, one cache for the batch, one forward pass per step.

Batching trades latency for throughput: each step reads the weights once for every row, so the
rows share the memory traffic that bounds decoding at batch 1. Rows are left-padded so that all
of them end at the same position and the next token of each is sampled from the same column;
padding is masked out of attention, and positions count real tokens only, so each row computes
what it would alone. A row that has finished keeps feeding padding until the batch is done.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.detok import IncrementalDetokenizer, StopMatcher
from llmcli.engine.loop import GenerationResult
from llmcli.engine.sampling import make_generator, pick_token, process_logits
from llmcli.engine.stats import GenerationStats

if TYPE_CHECKING:
    from llmcli.engine.structured.constraint import Constraint


class _Row:
    """One prompt's progress through the batch."""

    def __init__(
        self, prompt: list[int], tokenizer: Any, params: SamplingParams, constraint: Constraint | None
    ) -> None:
        self.prompt = prompt
        self.constraint = constraint
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopMatcher(params.stop)
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def take(self, token_id: int, eos_token_ids: frozenset[int]) -> None:
        self.token_ids.append(token_id)
        if token_id in eos_token_ids:
            self.finish_reason = "stop"
            self._flush()
            return
        if self.constraint is not None:
            self.constraint.advance(token_id)
        self.text += self.stop.feed(self.detok.push(token_id))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif self.constraint is not None and self.constraint.finished:
            self.finish_reason = "stop"
            self._flush()

    def end(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "length"
            self._flush()

    def _flush(self) -> None:
        tail = self.stop.feed(self.detok.flush())
        self.text += tail if self.stop.stopped else tail + self.stop.flush()


@torch.inference_mode()
def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    context_length: int,
    *,
    static_cache: bool = False,
    constraints: list[Constraint | None] | None = None,
) -> list[GenerationResult]:
    """Greedy or sampled generation for every prompt, in one batch; results in input order.
    `constraints`: a grammar per prompt (or None), masking that row's logits."""
    from transformers import DynamicCache, StaticCache

    device = model.device
    constraints = constraints or [None] * len(prompts)
    rows = [_Row(p, tokenizer, params, c) for p, c in zip(prompts, constraints, strict=True)]
    width = max(len(p) for p in prompts)
    budget = max(0, min(params.max_new_tokens, context_length - width))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_token_ids or {0})
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # Repetition penalty history: padding is filled with the row's own first token, which is
    # already in its history, so the pad id is not penalised by accident.
    seen = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts], device=device)
    cache = (
        StaticCache(config=model.config, max_cache_len=width + budget)
        if static_cache
        else DynamicCache(config=model.config)
    )
    generator = make_generator(params.seed, device) if not params.greedy else None
    start = time.perf_counter()
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        cache_position=torch.arange(width, device=device),
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1, :]
    next_position = mask.sum(-1, keepdim=True)
    ttft = 0.0
    for step in range(budget):
        for i, row in enumerate(rows):
            if row.constraint is not None and row.finish_reason is None:
                logits[i : i + 1] = row.constraint.mask(logits[i : i + 1])
        tokens = pick_token(process_logits(logits, seen, params), params, generator)
        token_ids = tokens.tolist()  # one host sync per step for the whole batch
        if step == 0:
            ttft = time.perf_counter() - start
        for row, token_id in zip(rows, token_ids, strict=True):
            if row.finish_reason is None:
                row.take(token_id, eos_token_ids)
        if all(row.finish_reason is not None for row in rows) or step + 1 == budget:
            break
        feed = torch.tensor(
            [
                [token_id if row.finish_reason is None else pad]
                for row, token_id in zip(rows, token_ids, strict=True)
            ],
            device=device,
        )
        if params.repetition_penalty != 1.0:
            seen = torch.cat([seen, tokens.view(-1, 1)], dim=1)
        mask = torch.cat([mask, torch.ones_like(feed)], dim=1)
        out = model(
            input_ids=feed,
            attention_mask=mask,
            position_ids=next_position,
            past_key_values=cache,
            cache_position=torch.tensor([width + step], device=device),
            use_cache=True,
        )
        logits = out.logits[:, -1, :]
        next_position = next_position + 1
    elapsed = time.perf_counter() - start
    results = []
    for row in rows:
        row.end()
        stats = GenerationStats(
            prompt_tokens=len(row.prompt),
            prefilled_tokens=len(row.prompt),
            completion_tokens=len(row.token_ids),
            ttft_s=ttft,
            decode_s=elapsed - ttft,
        )
        complete = None if row.constraint is None else row.constraint.complete
        results.append(
            GenerationResult(row.text, row.token_ids, row.finish_reason or "length", stats, complete)
        )
    return results
