"""A GPU server's sequences over one paged KV pool (engine/native/paged_slots.py, the default
layout on cuda): the scheduler's slots, steps graphed per batch size, give the contiguous
slots' tokens, and a pool too small for every sequence at once preempts and completes them all.
Skipped without CUDA; run with `pytest -m gpu` (tests/test_paged_serve.py runs the same server
on the CPU, eagerly)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from llmcli.config.settings import SamplingParams
from test_gpu import fp32_engines
from test_native import prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=48)
PROMPTS = [prompt(length, seed=90 + length) for length in (20, 45, 70, 33, 58)]


def served_tokens(loaded, *, paged: bool, kv_limit: int | None = None) -> tuple[list[list[int]], object, int]:
    """Every prompt's greedy tokens from a server's slots (5 generations at once, each in a
    thread of its own as a server runs them); the slots and the sequences preempted."""
    from llmcli.engine.loop import Engine
    from llmcli.engine.scheduler import ComputeThread, Slots

    compute = ComputeThread()
    preempted = []
    compute.on_preempt = lambda: preempted.append(1)
    try:
        slots = Slots(Engine.for_loaded(loaded), len(PROMPTS), compute, kv_limit, paged=paged)

        def generate(ids: list[int]) -> list[int]:
            with compute.generation():
                engine = slots.take(ids)
                try:
                    generation = engine.generate(ids, PARAMS, None)
                    list(generation)
                    return generation.result.token_ids
                finally:
                    slots.give_back(engine)

        with ThreadPoolExecutor(len(PROMPTS)) as generations:
            tokens = list(generations.map(generate, PROMPTS))
    finally:
        compute.shutdown()
    return tokens, slots, len(preempted)


def test_the_paged_server_path_gives_the_slots_tokens(tiny_llama: Path) -> None:
    loaded, _ = fp32_engines(tiny_llama)
    native = dataclasses.replace(loaded, engine="native")
    expected, slots, _ = served_tokens(native, paged=False)
    assert slots.batched is not None and slots.batched.graphs is not None
    tokens, paged, preempted = served_tokens(native, paged=True, kv_limit=1 << 30)
    assert tokens == expected and preempted == 0
    assert paged.paged is not None and paged.paged.steps.graphs.captures >= 1  # graphed on cuda
    # A pool of 12 blocks of 16 positions: two or three sequences at a time; the others wait.
    small = 12 * paged.paged.store.block_bytes()
    tokens, _, preempted = served_tokens(native, paged=True, kv_limit=small)
    assert tokens == expected and preempted >= 1
