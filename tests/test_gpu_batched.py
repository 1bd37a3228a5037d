"""The batched decode step in CUDA graphs (engine/native/batched.py), and a batching server's
lone sequence on the single-stream graph. Skipped without CUDA; run with `pytest -m gpu`."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from llmcli.config.settings import LoadSettings, SamplingParams
from test_batched_step import LENGTHS, decode_joining
from test_gpu import fp32_engines
from test_native import prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@torch.inference_mode()
def test_the_graphed_batched_step_gives_the_eager_steps_tokens(tiny_llama: Path) -> None:
    """Five sequences joining and leaving (batch buckets 4 → 8 → 4) across the length bucket
    256 → 512, in fp32: replayed graphs give the tokens and logits of the same fixed-shape step
    run eagerly, one graph per (batch bucket, length bucket) reached."""
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.engine.native.batched import BatchedDecode

    loaded, _ = fp32_engines(tiny_llama)
    net = NativeBackend(loaded.model, loaded.context_length).net
    prompts = [prompt(length, seed=70 + index) for index, length in enumerate(LENGTHS)]
    runs = {}
    for graphs in (False, True):
        batched = BatchedDecode(net, net.new_pool(loaded.context_length), graphs=graphs, static_shapes=True)
        runs[graphs] = decode_joining(batched, loaded.context_length, prompts)
    assert batched.graphs is not None and batched.graphs.captures >= 3  # (4, 256), (4, 512), (8, 512)
    (eager_tokens, eager_logits), (graphed_tokens, graphed_logits) = runs[False], runs[True]
    assert graphed_tokens == eager_tokens
    for eager, graphed in zip(eager_logits, graphed_logits, strict=True):
        torch.testing.assert_close(torch.cat(graphed), torch.cat(eager), rtol=0, atol=1e-5)


def test_a_lone_sequence_on_a_batching_server_replays_the_single_stream_graph(tiny_llama: Path) -> None:
    """A server's slots (scheduler.Slots, 4 at once) with one generation running: its steps
    replay its own decode graph, never the batched one, and its tokens are the plain engine's."""
    from llmcli.engine.loop import Engine
    from llmcli.engine.scheduler import ComputeThread, Slots

    loaded, _ = fp32_engines(tiny_llama)
    native = dataclasses.replace(loaded, engine="native")
    ids = prompt(40, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    plain = Engine.for_loaded(native)
    expected = plain.generate(ids, params, None)
    list(expected)
    compute = ComputeThread()
    try:
        slots = Slots(Engine.for_loaded(native), 4, compute)
        assert slots.batched is not None and slots.batched.graphs is not None

        def alone() -> tuple[list[int], Engine]:
            with compute.generation():
                engine = slots.take(ids)
                try:
                    generation = engine.generate(ids, params, None)
                    list(generation)
                    return generation.result.token_ids, engine
                finally:
                    slots.give_back(engine)

        with ThreadPoolExecutor(1) as generations:
            tokens, engine = generations.submit(alone).result()
    finally:
        compute.shutdown()
    assert tokens == expected.result.token_ids
    assert engine.backend.inner.graphs.captures >= 1
    assert slots.batched.graphs.captures == 0


@pytest.mark.parametrize(("fast", "batches"), [(None, True), (False, False)])
def test_a_gpu_server_batches_by_default_where_its_steps_are_graphed(
    tiny_llama: Path, fast: bool | None, batches: bool
) -> None:
    """`serve` without --parallel on a GPU: several generations at once (as many whole contexts
    as the KV memory holds, at most 16) where the steps replay graphs; one with --no-fast."""
    from llmcli.engine.loop import Engine
    from llmcli.frontends.serve import DEFAULT_PARALLEL_GPU, ServeRequest, _parallel, kv_memory_default

    loaded, _ = fp32_engines(tiny_llama)
    engine = Engine.for_loaded(dataclasses.replace(loaded, engine="native", fast=fast))
    request = ServeRequest(
        model=None, host="127.0.0.1", port=0, api_key=None, load=LoadSettings(device="cuda")
    )
    count = _parallel(request, engine, kv_memory_default(engine.device))
    assert count == (DEFAULT_PARALLEL_GPU if batches else 1)
