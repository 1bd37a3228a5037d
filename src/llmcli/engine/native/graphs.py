"""CUDA graphs for the native decode step (and the check pass of speculative decoding), one per
shape — (rows, KV length bucket) — without torch.compile.

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python they
cost more than they compute. A `torch.cuda.CUDAGraph` records the step once and replays it with
one launch. The step reads its token and position from fixed device buffers and attends over a
fixed span (its length bucket, with later slots masked), so one graph serves every position in
its bucket. A check pass of R drafted tokens is the same with R rows (padded to a few sizes).
Graphs are captured lazily, the first time a shape is reached, and share one memory pool (only
the latest replay's logits are ever in use). When the KV cache grows its tensors move, and
every graph is captured again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class StepGraphs:
    def __init__(self, step: Callable[[int, int], torch.Tensor]) -> None:
        self._step = step  # (rows, bucket) → logits, reading the token and position buffers
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._storage_version = -1
        self._pool = None
        self.captures = 0
        self.capture_s = 0.0

    def replay(self, rows: int, bucket: int, storage_version: int) -> torch.Tensor:
        if storage_version != self._storage_version:
            self._graphs.clear()  # the cache moved: graphs recorded its old addresses
            self._pool = None
            self._storage_version = storage_version
        captured = self._graphs.get((rows, bucket))
        if captured is None:
            captured = self._graphs[rows, bucket] = self._capture(rows, bucket)
        captured.graph.replay()
        return captured.logits

    def _capture(self, rows: int, bucket: int) -> _Captured:
        import time

        start = time.perf_counter()
        # Warm-up runs on a side stream, as capture requires; they compute the very step about to
        # be replayed (same tokens, same positions), so what they write into the cache is right.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(rows, bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(rows, bucket)
        if self._pool is None:
            self._pool = graph.pool()
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return _Captured(graph, logits)
