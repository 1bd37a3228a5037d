"""`llmcli bench`: load (or build) the model, measure, print a table or JSON."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmcli.config.settings import LoadSettings, SpeculativeSettings
from llmcli.errors import EXIT_OK, UsageError
from llmcli.frontends import terminal
from llmcli.frontends.loading import engine_with_feedback, load_with_feedback, speculation_with_feedback

if TYPE_CHECKING:
    from llmcli.engine.loop import Engine
    from llmcli.engine.speculative import Speculation
    from llmcli.models.load import LoadedModel


@dataclass(frozen=True)
class BenchRequest:
    model: str | None
    config: str | None
    prompt_lengths: list[int]
    new_tokens: int
    runs: int
    with_generate: bool
    with_compiled: bool | None
    context_fill: int | None
    json: bool
    load: LoadSettings
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    concurrency: list[int] | None = None  # sequences at once, 1 among them; None: the usual bench
    kv_layout: str | None = None  # their caches: "paged" or "slots" (None: a server's default)


def run(request: BenchRequest) -> int:
    mtp = request.speculative.method == "mtp"
    if request.config and mtp:  # before the weights are made
        raise UsageError("--speculative mtp drafts with a checkpoint's MTP head: random weights have none")
    if request.config:
        from llmcli.models.load import load_random

        with terminal.status(f"Building {request.config} with random weights…"):
            loaded = load_random(request.config, request.load)
    else:
        loaded = load_with_feedback(request.model, request.load, lean=_lean(request), mtp=mtp)
    engine = engine_with_feedback(loaded)
    if request.speculative.method != "off":
        return _run_speculative(request, loaded, engine)
    if request.concurrency is not None:
        return _run_concurrency(request, loaded, engine)
    from llmcli.engine.bench import run_bench
    from llmcli.frontends.bench_tables import render_table

    with terminal.status("Measuring…"):
        report = run_bench(
            loaded,
            prompt_lengths=request.prompt_lengths,
            new_tokens=request.new_tokens,
            runs=request.runs,
            with_generate=request.with_generate,
            with_compiled=request.with_compiled,
            context_fill=request.context_fill,
            engine=engine,
        )
    sys.stdout.write((json.dumps(report.as_dict()) if request.json else render_table(report)) + "\n")
    return EXIT_OK


def _lean(request: BenchRequest) -> bool:
    """Whether the model may load as `generate` loads it (lean: what the native engine runs, and
    the weights figure `generate --json` gives), not through transformers: only when no contender
    needs transformers' model (model.generate, its compiled path, batches, a draft)."""
    if request.speculative.method == "mtp":
        return True  # the MTP head drafts on the native engine only (its bench has no generate)
    if request.with_generate or request.with_compiled or request.concurrency is not None:
        return False
    if request.speculative.method != "off":
        return False
    if request.with_compiled is None:  # the default: compiled on CUDA
        from llmcli.models.device import choose_device

        return choose_device(request.load.device).type != "cuda"
    return True


def _run_speculative(request: BenchRequest, loaded: LoadedModel, plain) -> int:
    from llmcli.engine.speculative.bench import run_speculative_bench
    from llmcli.frontends.bench_tables import render_speculative_table
    from llmcli.frontends.bench_tasks import COPY_TASK, FREE_FORM

    speculating = engine_with_feedback(loaded)  # its own cache and graphs, the same weights
    speculating.speculation = _speculation(request, loaded, speculating)
    with terminal.status("Measuring…"):
        report = run_speculative_bench(
            loaded,
            plain,
            speculating,
            prompt_length=request.prompt_lengths[0],
            new_tokens=request.new_tokens,
            runs=request.runs,
            tasks=[COPY_TASK, *FREE_FORM],
        )
    text = json.dumps(report.as_dict()) if request.json else render_speculative_table(report)
    sys.stdout.write(text + "\n")
    return EXIT_OK


def _run_concurrency(request: BenchRequest, loaded: LoadedModel, engine) -> int:
    from llmcli.engine.batch_bench import run_concurrency_bench
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.frontends.bench_tables import render_concurrency_table

    assert request.concurrency is not None
    if not isinstance(engine.backend, NativeBackend):
        raise UsageError(
            f"--concurrency measures the native engine's batched step; this model runs on the "
            f"{engine.name} engine, which decodes one sequence per step"
        )
    from llmcli.engine.native.paged_slots import default_layout, paged_refusal

    layout = request.kv_layout or default_layout(engine.device)
    refusal = paged_refusal(engine.backend) if layout == "paged" else None
    if refusal is not None and request.kv_layout is not None:
        raise UsageError(refusal)
    length = request.prompt_lengths[0]
    if length + request.new_tokens > loaded.context_length:
        raise UsageError(
            f"a prompt of {length} and {request.new_tokens} new tokens do not fit the "
            f"{loaded.context_length}-token context"
        )
    with terminal.status("Measuring…"):
        report = run_concurrency_bench(
            loaded,
            engine,
            levels=request.concurrency,
            prompt_length=length,
            new_tokens=request.new_tokens,
            runs=request.runs,
            paged=layout == "paged" and refusal is None,
        )
    text = json.dumps(report.as_dict()) if request.json else render_concurrency_table(report)
    sys.stdout.write(text + "\n")
    return EXIT_OK


def _speculation(request: BenchRequest, loaded: LoadedModel, engine: Engine) -> Speculation | None:
    speculative = request.speculative
    if not request.config:
        return speculation_with_feedback(loaded, request.model, speculative, request.load, engine)
    if speculative.method == "lookup":
        return speculation_with_feedback(loaded, None, speculative, request.load)
    if speculative.draft_model != "self":
        raise UsageError(
            "with --random-weights the draft model can only be self (the same random weights in int4)"
        )
    # The same seed builds the same random weights; this copy is quantized to int4.
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.speculative.drafters import ModelDrafter
    from llmcli.engine.speculative.schedule import DraftLength
    from llmcli.models.load import load_random

    with terminal.status(f"Building the int4 copy of {request.config}…"):
        drafting = load_random(request.config, dataclasses.replace(request.load, quant="int4", engine="auto"))
    drafter = ModelDrafter(engine_with_feedback(drafting), "self (int4)")
    return Speculation(drafter, DraftLength(speculative.draft_tokens))
