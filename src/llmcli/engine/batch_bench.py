"""`llmcli bench --concurrency 1,2,4,8`: the decode speed of several sequences at once, each
level beside one sequence alone in the same run.

At each level C, C sequences (each its own cache over the shared weights, slots of one pool, as
a server's generations are: scheduler.Slots) are prefilled with their own prompt, then decoded greedily
together, one step for all of them (batched.BatchedDecode, what `llmcli serve --parallel` runs:
on CUDA a graph per batch bucket and length bucket; one sequence alone its own step's graph).
Only the decode steps are timed; the levels' runs are interleaved so drift in machine speed
hits them alike, and with them one sequence on the engine's own step and cache (what a server
running one generation at a time decodes), which C = 1 (a batching server's lone sequence) is
reported against. Reported per level: the aggregate tok/s (tokens of every sequence over the
steps' wall time), its ratio to C = 1, what one sequence sees, and the KV memory the C caches
hold at the end beside the tokens they hold. What a server adds (HTTP, one thread per request)
is not here: scripts/bench_concurrency.py measures that through real clients. With `paged` the
C caches are sequences of one paged pool instead, stepped by paged_slots.PagedSlots (`serve
--kv-layout paged`, a GPU server's default: one graph per batch size for every length).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmcli.engine.bench import low_high, prompt_of, synchronize, timed
from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.batched import BatchedDecode
from llmcli.engine.native.blocks import BLOCK_SIZE
from llmcli.engine.native.paged_slots import PagedSlots
from llmcli.models.load import LoadedModel


@dataclass
class ConcurrencyLevel:
    sequences: int
    aggregate_tok_s: float
    spread: tuple[float, float]  # the lowest and highest run's aggregate tok/s
    per_sequence_tok_s: float
    versus_one: float  # aggregate ÷ the C = 1 aggregate of the same run
    kv_bytes: int  # what the C caches hold at the end of a run
    kv_tokens: int  # the tokens they hold then


@dataclass
class ConcurrencyReport:
    model: str
    device: str
    dtype: str
    quant: str
    prompt_length: int
    new_tokens: int
    runs: int
    kv_bytes_per_token: int
    # How the steps ran: "CUDA graphs", "fixed shapes, eager" (--fast on a CPU) or "eager"; and
    # why several sequences' step took no fixed shapes where it did not (batched.eager_reason).
    steps: str = "eager"
    kv_layout: str = "slots"  # the C caches: slots of a contiguous pool, or one paged pool
    batched_eager_reason: str | None = None
    # One sequence on the engine's own step and cache (what one generation at a time runs), and
    # the C = 1 level (one sequence in a slot of the pool, as a batching server's lone one) ÷ it.
    single_stream_tok_s: float = 0.0
    lone_versus_single_stream: float = 0.0
    levels: list[ConcurrencyLevel] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_concurrency_bench(
    loaded: LoadedModel,
    engine: Engine,
    *,
    levels: list[int],
    prompt_length: int,
    new_tokens: int,
    runs: int,
    paged: bool = False,
) -> ConcurrencyReport:
    first = engine.backend
    if not isinstance(first, NativeBackend):
        raise ValueError(f"the {engine.name} engine decodes one sequence per step")
    assert levels[0] == 1, "every level is reported beside one sequence alone"
    vocab = first.net.embedding.shape[0]
    # One backend per sequence at the highest level, sharing the weights, their caches slots of
    # one pool as a server's are; each level uses the first C.
    # Their steps take the first's shapes, as a server's slots do: on CUDA a graph per bucket for
    # one sequence alone and per (batch bucket, length bucket) for several (batched.py).
    context = first.cache.context_length
    pool = first.net.new_pool(context)
    graphed, fixed = first.graphs is not None, first.static_shapes
    backends: list[NativeBackend]
    batched: BatchedDecode | PagedSlots
    if paged:  # room for what every sequence fills: the bench measures steps, not preemption
        room = first.kv_bytes_for(prompt_length + new_tokens + BLOCK_SIZE) * max(levels)  # + rounding
        paged_slots = PagedSlots(first.net, context, room, graphs=graphed)
        backends = [paged_slots.backend(first.net) for _ in range(max(levels))]
        batched = paged_slots
    else:
        backends = [
            NativeBackend(None, context, net=first.net, pool=pool, graphs=graphed, static_shapes=fixed)
            for _ in range(max(levels))
        ]
        batched = BatchedDecode(first.net, pool, graphs=graphed, static_shapes=fixed)
    prompts = [prompt_of(prompt_length + index, vocab)[:prompt_length] for index in range(len(backends))]
    report = ConcurrencyReport(
        model=loaded.name,
        device=str(first.device),
        dtype=loaded.dtype_name,
        quant=loaded.quant,
        prompt_length=prompt_length,
        new_tokens=new_tokens,
        runs=runs,
        kv_bytes_per_token=loaded.kv_bytes_per_token,
        steps="CUDA graphs" if graphed else "fixed shapes, eager" if fixed else "eager",
        kv_layout="paged" if paged else "slots",
        batched_eager_reason=None if paged else batched.eager_reason,  # type: ignore[union-attr]
    )
    seconds: dict[int, list[float]] = {level: [] for level in levels}
    single: list[float] = []
    held: dict[int, tuple[int, int]] = {}
    # Two warm-ups, not counted: the first grows the pool level by level, which moves every
    # cache (so a graph captured at a lower level is captured again); the second captures them
    # on the tensors the counted runs use.
    warm_ups = 2
    for run in range(runs + warm_ups):
        elapsed = _decode_together([first], prompts, new_tokens, batched)
        first.reset()
        if run >= warm_ups:
            single.append(elapsed)
        for level in levels:
            taking = backends[:level]
            elapsed = _decode_together(taking, prompts, new_tokens, batched)
            if run >= warm_ups:
                seconds[level].append(elapsed)
            held[level] = (sum(b.cache.nbytes() for b in taking), sum(b.cache.length for b in taking))
            for backend in taking:
                backend.reset()
    one = statistics.median(new_tokens / elapsed for elapsed in seconds[1])
    report.single_stream_tok_s = statistics.median(new_tokens / elapsed for elapsed in single)
    report.lone_versus_single_stream = one / report.single_stream_tok_s
    for level in levels:
        rates = [level * new_tokens / elapsed for elapsed in seconds[level]]
        aggregate = statistics.median(rates)
        report.levels.append(
            ConcurrencyLevel(
                sequences=level,
                aggregate_tok_s=aggregate,
                spread=low_high(rates),
                per_sequence_tok_s=aggregate / level,
                versus_one=aggregate / one,
                kv_bytes=held[level][0],
                kv_tokens=held[level][1],
            )
        )
    return report


@torch.inference_mode()
def _decode_together(
    backends: list[NativeBackend],
    prompts: list[list[int]],
    new_tokens: int,
    batched: BatchedDecode | PagedSlots,
) -> float:
    """Prefill each sequence, then time `new_tokens` greedy steps of all of them together."""
    logits = torch.cat([backend.prefill(ids) for backend, ids in zip(backends, prompts, strict=False)])
    caches = [backend.cache for backend in backends]
    device = backends[0].device

    def steps() -> None:
        nonlocal logits
        for _ in range(new_tokens):
            tokens = logits.argmax(dim=-1)
            if len(backends) == 1:  # alone, as a server runs one sequence: its own decode step
                logits = backends[0].decode(tokens)
                continue
            logits = batched.step(tokens, caches)

    synchronize(device)
    return timed(steps, device)
