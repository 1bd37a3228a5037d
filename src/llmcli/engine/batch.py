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
from llmcli.engine.hf import with_cache
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

    def result(self, ttft: float, elapsed: float) -> GenerationResult:
        self.end()
        stats = GenerationStats(
            prompt_tokens=len(self.prompt),
            prefilled_tokens=len(self.prompt),
            completion_tokens=len(self.token_ids),
            ttft_s=ttft,
            decode_s=elapsed - ttft,
        )
        complete = None if self.constraint is None else self.constraint.complete
        return GenerationResult(self.text, self.token_ids, self.finish_reason or "length", stats, complete)

    def _flush(self) -> None:
        tail = self.stop.feed(self.detok.flush(cut=self.finish_reason == "length"))
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
    native: bool = False,
) -> list[GenerationResult]:
    """Greedy or sampled generation for every prompt, in one batch; results in input order.
    `constraints`: a grammar per prompt (or None), masking that row's logits. `native`: on
    llmcli's own forward (a cache per prompt, no padding), else on transformers' model."""
    constraints = constraints or [None] * len(prompts)
    rows = [_Row(p, tokenizer, params, c) for p, c in zip(prompts, constraints, strict=True)]
    kind = _NativeBatch if native else _Batch
    batch = kind(model, rows, params, eos_token_ids, context_length, tokenizer.pad_token_id)
    start = time.perf_counter()
    logits = batch.prefill(static_cache)
    ttft = 0.0
    for step in range(batch.budget):
        tokens = batch.choose(logits)
        if step == 0:
            ttft = time.perf_counter() - start
        if batch.done or step + 1 == batch.budget:
            break
        logits = batch.step(tokens, step)
    elapsed = time.perf_counter() - start
    return [row.result(ttft, elapsed) for row in rows]


class _Batch:
    """The batch's tensors: inputs left-padded to one width, the attention mask, positions,
    the repetition penalty's history, and one KV cache."""

    def __init__(
        self,
        model: Any,
        rows: list[_Row],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        context_length: int,
        pad_token_id: int | None,
    ) -> None:
        self.model, self.rows, self.params, self.eos_token_ids = model, rows, params, eos_token_ids
        self.device = device = model.device
        prompts = [row.prompt for row in rows]
        self.width = width = max(len(p) for p in prompts)
        self.budget = max(0, min(params.max_new_tokens, context_length - width))
        self.pad = pad_token_id if pad_token_id is not None else min(eos_token_ids or {0})
        self.input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # Repetition penalty history: padding is filled with the row's own first token, which is
        # already in its history, so the pad id is not penalised by accident.
        self.seen = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts], device=device)
        self.next_position = self.mask.sum(-1, keepdim=True)
        self.generator = make_generator(params.seed, device) if not params.greedy else None
        self.cache: Any = None

    @property
    def done(self) -> bool:
        return all(row.finish_reason is not None for row in self.rows)

    def prefill(self, static_cache: bool) -> torch.Tensor:
        from transformers import DynamicCache, StaticCache

        config = self.model.config
        self.cache = (
            StaticCache(config=config, max_cache_len=self.width + self.budget)
            if static_cache
            else DynamicCache(config=config)
        )
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            position_ids=(self.mask.cumsum(-1) - 1).clamp(min=0),
            **with_cache(self.model, self.cache),
            cache_position=torch.arange(self.width, device=self.device),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token (a grammar masks its own row); the rows still going take it."""
        for i, row in enumerate(self.rows):
            if row.constraint is not None and row.finish_reason is None:
                logits[i : i + 1] = row.constraint.mask(logits[i : i + 1])
        tokens = pick_token(process_logits(logits, self.seen, self.params), self.params, self.generator)
        for row, token_id in zip(self.rows, tokens.tolist(), strict=True):  # one host sync a step
            if row.finish_reason is None:
                row.take(token_id, self.eos_token_ids)
        return tokens

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed each row's token (padding for rows that have finished); the next logits."""
        feed = torch.tensor(
            [[row.token_ids[-1] if row.finish_reason is None else self.pad] for row in self.rows],
            device=self.device,
        )
        if self.params.needs_history:
            self.seen = torch.cat([self.seen, tokens.view(-1, 1)], dim=1)
        self.mask = torch.cat([self.mask, torch.ones_like(feed)], dim=1)
        out = self.model(
            input_ids=feed,
            attention_mask=self.mask,
            position_ids=self.next_position,
            **with_cache(self.model, self.cache),
            cache_position=torch.tensor([self.width + step], device=self.device),
            use_cache=True,
        )
        self.next_position = self.next_position + 1
        return out.logits[:, -1, :]


class _NativeBatch(_Batch):
    """The batch on the native forward: each prompt prefilled alone into its own slot of one
    pool (native/pool.py), then one step for the rows still going, each at its own position
    (plans.SequencesStep): the weights read once for them all, one attention call per layer,
    and a row that has finished costs nothing more. Sampling is the batch's own."""

    def prefill(self, static_cache: bool) -> torch.Tensor:
        from llmcli.engine.native.backend import NativeBackend
        from llmcli.engine.native.forward import Transformer

        context = self.width + self.budget
        net = Transformer(self.model, context)
        pool = net.new_pool(context)
        self.backends = [NativeBackend(None, context, net=net, pool=pool) for _ in self.rows]
        return torch.cat([b.prefill(row.prompt) for b, row in zip(self.backends, self.rows, strict=True)])

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        if self.params.needs_history:
            self.seen = torch.cat([self.seen, tokens.view(-1, 1)], dim=1)
        going = [i for i, row in enumerate(self.rows) if row.finish_reason is None]
        feed = torch.tensor([self.rows[i].token_ids[-1] for i in going], device=self.device)
        caches = [self.backends[i].cache for i in going]
        rows = self.backends[0].net.decode_sequences(feed, caches)
        # Rows that have finished get logits of zeros: choose() takes no token from them.
        logits = torch.zeros(len(self.rows), rows.shape[-1], device=self.device)
        logits[going] = rows
        return logits
