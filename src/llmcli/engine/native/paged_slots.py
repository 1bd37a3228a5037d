"""A server's sequences over one paged KV pool (the `paged` KV layout): every slot a
PagedBackend over one PagedStore sized from the KV memory, the decode steps of all of them one
PagedSteps (graphed on a GPU: one graph per batch size for every slot and length).

The other layout, `slots`, is pool.SlotPool's contiguous slots: the CPU's default, where issue
28 measured that attention over gathered blocks costs more than sharing them saves. On a GPU the
paged layout is the default: a step reads each sequence's blocks in place (paged_cuda.py), a
system prompt's blocks are computed once for every request that starts with it, and memory is
taken block by block as sequences grow, not reserved per request up to its max_tokens. The
scheduler (scheduler.py) and the prefix store take either.
"""

from __future__ import annotations

from typing import Any

import torch

from llmcli.engine.native.paged_backend import PagedBackend
from llmcli.engine.native.paged_kvcache import PagedStore
from llmcli.engine.native.paged_step import GRAPHED_BATCHES, PagedSteps

KV_LAYOUTS = ("paged", "slots")


def default_layout(device: torch.device) -> str:
    """The KV layout a server takes where none is asked for: paged on a GPU, slots elsewhere."""
    return "paged" if device.type == "cuda" else "slots"


def paged_refusal(backend: Any) -> str | None:
    """Why `backend`'s model cannot run over a paged pool (one line), or None where it can."""
    from llmcli.engine.native.backend import NativeBackend

    if not isinstance(backend, NativeBackend):
        return f"--kv-layout paged needs the native engine; this model runs on the {backend.name} engine"
    _, _, kept = backend.net._slots()
    if backend.net.recurrent or not all(kept):
        return (
            "--kv-layout paged holds models whose every layer keeps its own keys and values: "
            "this one has recurrent or shared-KV layers (use --kv-layout slots)"
        )
    return None


class PagedSlots:
    """One model's paged pool and the decode steps of its sequences: `store` holds
    `kv_limit` bytes of blocks (at least one block; None: one context's), `steps` every slot's
    decode step."""

    def __init__(self, net: Any, context_length: int, kv_limit: int | None, *, graphs: bool) -> None:
        probe = PagedStore.for_net(net, 1)  # a block's bytes, before the pool is made
        blocks = -(-context_length // probe.block_size)
        if kv_limit is not None:
            blocks = max(1, kv_limit // probe.block_bytes())
        del probe
        self.store = PagedStore.for_net(net, blocks)
        self.steps = PagedSteps(net, self.store, context_length, graphs=graphs)
        self.context_length = context_length

    def backend(self, net: Any) -> PagedBackend:
        """One more sequence over the pool."""
        return PagedBackend(None, self.context_length, net=net, store=self.store, steps=self.steps)

    def step(self, tokens: torch.Tensor, caches: list[Any]) -> torch.Tensor:
        """The decode step of several sequences (scheduler.ComputeThread's `batched`): logits
        [B, vocab], a view the next step overwrites."""
        return self.steps.decode(tokens.tolist(), caches)


# The most sequences one paged step takes: a server runs at most this many at once.
MOST_SEQUENCES = GRAPHED_BATCHES[-1]
