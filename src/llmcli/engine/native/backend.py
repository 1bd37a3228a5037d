"""The native backend: llmcli's forward pass over its own KV cache, graph-captured on CUDA."""

from __future__ import annotations

import time
from typing import Any

import torch

from llmcli.engine.native.graphs import DecodeGraphs
from llmcli.engine.native.llama import Transformer

# Long prompts are prefilled in chunks: attention after cached tokens needs a mask of chunk ×
# cached positions (and, on kernels without grouped-query support, scores as large), which a
# chunk bounds; each chunk is still large enough to keep the matrix units busy.
PREFILL_CHUNK = 1024


class NativeBackend:
    """`graphs`: replay the decode step as a CUDA graph per length bucket. `static_shapes`:
    run that very bucketed, masked step eagerly (what a graph would replay; on a CPU this is how
    tests check it). Neither: the decode step attends over exactly the filled length."""

    name = "native"

    def __init__(
        self, model: Any, context_length: int, *, graphs: bool = False, static_shapes: bool = False
    ) -> None:
        self.net = Transformer(model)
        self.device = self.net.device
        self.cache = self.net.new_cache(context_length)
        self.static_shapes = static_shapes or graphs
        # The decode step's inputs live at fixed addresses, for the graphs to read.
        self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self._position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graphs = DecodeGraphs(self._bucket_step) if graphs else None

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        for chunk in tokens.split(PREFILL_CHUNK):
            logits = self.net.prefill(chunk, self.cache)
        return logits

    @torch.inference_mode()
    def score(self, ids: list[int]) -> torch.Tensor:
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.net.verify(tokens, self.cache, buckets=self.static_shapes)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        position = self.cache.length
        self.cache.ensure(position + 1)
        if self.static_shapes:
            self._token.copy_(token.view(1))
            self._position.fill_(position)
            bucket = self.cache.bucket_for(position + 1)
            if self.graphs is not None:
                logits = self.graphs.replay(bucket, self.cache.storage_version)
            else:
                logits = self._bucket_step(bucket)
        else:
            where = torch.tensor([position], device=self.device)
            logits = self.net.decode(token.view(1), where, self.cache, position + 1, masked=False)
        self.cache.length = position + 1
        return logits

    def _bucket_step(self, bucket: int) -> torch.Tensor:
        return self.net.decode(self._token, self._position, self.cache, bucket, masked=True)

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def reset(self) -> None:
        self.cache.crop(0)  # the tensors stay, and with them any captured graph

    @property
    def captures_graphs(self) -> bool:
        return self.graphs is not None

    def warm_up(self) -> float:
        """Capture the first bucket's graph now rather than in the first reply."""
        start = time.perf_counter()
        logits = self.prefill([0])
        for _ in range(2):
            logits = self.decode(logits.argmax(dim=-1))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset()
        return time.perf_counter() - start
