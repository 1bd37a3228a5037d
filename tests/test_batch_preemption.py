"""An out-of-memory error in a server's batched decode step (engine/scheduler.py): the newest
sequence is preempted and requeued, the others never see the error, and every sequence's
tokens are what it gives alone. Through the scheduler's own compute thread and slots, the
generations in threads of their own as a server runs them, on the fixed-shape step
(`static_shapes`, what a GPU's graphs replay) of a tiny fp32 model."""

from __future__ import annotations

import threading

import pytest
import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.scheduler import ComputeThread, Slots
from test_native import CASES, CONTEXT, build, prompt

from cli_helpers import PATIENCE_S

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=24)
PROMPTS = [prompt(length, seed=80 + length) for length in (30, 60, 45)]


def alone(model: torch.nn.Module, ids: list[int]) -> list[int]:
    engine = Engine(NativeBackend(model, CONTEXT, static_shapes=True), frozenset(), CONTEXT)
    generation = engine.generate(ids, PARAMS, None)
    list(generation)
    return generation.result.token_ids


def test_out_of_memory_in_a_batched_step_preempts_the_newest_sequence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three generations join one after another (each starts once the one before decodes); the
    second step of all three runs, then raises torch.OutOfMemoryError, as a GPU's step does
    when its memory runs out part way. A CPU cannot run out of a GPU's memory, so the error is
    raised by hand here — the one place in the suite a raised error stands in for the real one
    (tests/test_gpu.py fills a real GPU's memory). The step runs again with the two oldest
    (their caches set back to before it), the newest on its own after them, and every
    generation's tokens are what it gives alone."""
    model = build(*CASES["llama-gqa2"])
    expected = [alone(model, ids) for ids in PROMPTS]
    compute = ComputeThread()
    slots = Slots(Engine(NativeBackend(model, CONTEXT, static_shapes=True), frozenset(), CONTEXT), 3, compute)
    assert slots.batched is not None and slots.batched.fixed
    batched, step = slots.batched, slots.batched.step
    steps: list[list[object]] = []  # each batched step's caches
    raised: list[int] = []  # the step that raised

    def running_out(tokens: torch.Tensor, caches: list) -> torch.Tensor:
        steps.append(list(caches))
        rows = step(tokens, caches)
        if len(caches) == 3 and sum(len(held) == 3 for held in steps) == 2:
            raised.append(len(steps) - 1)
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return rows

    monkeypatch.setattr(batched, "step", running_out)
    caches: list[object] = [None] * 3
    results: list[list[int] | None] = [None] * 3
    taken = [threading.Event() for _ in PROMPTS]
    threads: list[threading.Thread] = []

    def generate(index: int) -> None:
        with compute.generation():
            engine = slots.take(PROMPTS[index])
            caches[index] = engine.backend.inner.cache
            taken[index].set()
            try:
                generation = engine.generate(PROMPTS[index], PARAMS, None)
                list(generation)
                results[index] = generation.result.token_ids
            finally:
                slots.give_back(engine)

    def start(index: int) -> None:
        threads.append(threading.Thread(target=generate, args=(index,)))
        threads[-1].start()
        assert taken[index].wait(PATIENCE_S)

    def next_joins(count: int) -> None:  # on the compute thread, before a step of `count`
        if count == len(threads) < len(PROMPTS):
            start(count)

    compute.on_step = next_joins
    try:
        start(0)
        for thread in threads:  # the later ones are in the list before the first ends
            thread.join(PATIENCE_S)
    finally:
        compute.shutdown()
    assert results == expected
    assert raised, "no step held all three sequences"
    newest_left_out = steps[raised[0] + 1]
    assert newest_left_out == caches[:2]  # the two oldest; the newest stepped alone after them
