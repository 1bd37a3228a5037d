"""The decode step of several sequences in one pool, with fixed shapes: a CUDA graph per (batch
bucket, length bucket) serves every batch of that shape.

The eager batched step (plans.SequencesStep) attends over exactly each sequence's positions and
picks its attention per step (one call over a run of slots, or one per sequence): a few hundred
launches with shapes that change every token, which a GPU spends more time launching than
computing, so it cannot be recorded once and replayed. Here the batch is padded to a bucket (2,
4, 8, 16), each row's token, position and slot are read from fixed device buffers, and every
row attends over the length bucket of the longest sequence, its later positions masked
(plans.PaddedRows): the shapes and addresses depend on the two buckets alone. Rows that only
pad write a slot no sequence holds. The same step runs eagerly with `static_shapes` (a CPU's
tests check it there); graphs are captured lazily, the first time a shape is reached, and
again when the pool's tensors move (graphs.py).

Models whose layers are not all in the pool keep the eager batched step (`eager_reason`):
sliding-window layers that keep a ring per sequence (Gemma 2, 3 and 4, gpt-oss, Mistral v0.1:
where the window is shorter than the context), and recurrent states (Qwen3.5), whose tensors
are each sequence's own, at addresses a graph of the batch cannot follow. So do batches past
MAX_FIXED_BATCH: a mixture of experts takes its graphable per-row path up to that many rows
(families/moe.py CHECK_ROWS), and one bound for every model keeps the rule simple.
"""

from __future__ import annotations

import torch

from llmcli.engine.native.families.moe import CHECK_ROWS
from llmcli.engine.native.forward import Transformer
from llmcli.engine.native.graphs import StepGraphs
from llmcli.engine.native.kvcache import KVCache
from llmcli.engine.native.pool import SlotPool

MAX_FIXED_BATCH = CHECK_ROWS


def batch_bucket(count: int) -> int:
    """The rows a step of `count` sequences runs: the next power of two."""
    return 1 << (count - 1).bit_length()


def eager_reason(net: Transformer, pool: SlotPool) -> str | None:
    """Why this model's batched decode step cannot take fixed shapes, or None: it can."""
    if net.recurrent:
        return "its recurrent layers keep a state per sequence"
    if not all(block.attention is not None and pool.pooled[block.attention.layer] for block in net.blocks):
        return "its sliding-window layers keep a ring per sequence"
    return None


class BatchedDecode:
    """One decode step for the sequences of one pool. `graphs`: replay a CUDA graph per (batch
    bucket, length bucket); `static_shapes`: run that very step eagerly. Neither, or a model or
    batch the fixed shapes do not serve: the eager batched step (Transformer.decode_sequences)."""

    def __init__(self, net: Transformer, pool: SlotPool, *, graphs: bool, static_shapes: bool) -> None:
        self.net, self.pool = net, pool
        self.eager_reason = eager_reason(net, pool)
        self.fixed = (graphs or static_shapes) and self.eager_reason is None
        device = net.device
        self._tokens = torch.zeros(MAX_FIXED_BATCH, dtype=torch.long, device=device)
        self._where = torch.zeros(2, MAX_FIXED_BATCH, dtype=torch.long, device=device)  # positions, slots
        self.graphs = StepGraphs(self._step) if graphs and self.fixed else None

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Token b [B] after what caches[b] holds; logits [B, vocab], row b what the sequence's
        own decode step gives (within rounding); each cache holds its token after."""
        count = len(caches)
        if not self._takes(caches):
            return self.net.decode_sequences(tokens, caches)
        rows = batch_bucket(count)
        for cache in caches:
            cache.ensure(cache.length + 1)
        scratch = self.pool.scratch_slot()  # after the caches' growth: it may make room past them
        positions = [cache.length for cache in caches]
        bucket = caches[0].bucket_for(max(positions) + 1)
        pad = rows - count
        slots = [cache.slot for cache in caches]
        self._where[:, :rows].copy_(torch.tensor([positions + [0] * pad, slots + [scratch] * pad]))
        self._tokens[:count].copy_(tokens.view(-1))
        self._tokens[count:rows].zero_()
        if self.graphs is not None:
            logits = self.graphs.replay(rows, bucket, self.pool.storage_version)
        else:
            logits = self._step(rows, bucket)
        for cache in caches:
            cache.length += 1
        return logits[:count]

    def _takes(self, caches: list[KVCache]) -> bool:
        """Whether these caches' step takes the fixed shapes: all in this pool, few enough, and
        none after an image that moved text positions (a graph replays the positions it writes)."""
        return (
            self.fixed
            and len(caches) <= MAX_FIXED_BATCH
            and all(cache.pool is self.pool and not cache.shifts for cache in caches)
        )

    def _step(self, rows: int, bucket: int) -> torch.Tensor:
        positions, slots = self._where[0, :rows], self._where[1, :rows]
        return self.net.decode_padded(self._tokens[:rows], positions, slots, self.pool, bucket)
