"""`llmcli bench`: load (or build) the model, measure, print a table or JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from llmcli.config.settings import LoadSettings
from llmcli.errors import EXIT_OK
from llmcli.frontends import terminal
from llmcli.frontends.loading import engine_with_feedback, load_with_feedback


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


def run(request: BenchRequest) -> int:
    from llmcli.engine.bench import render_table, run_bench

    if request.config:
        from llmcli.models.load import load_random

        with terminal.status(f"Building {request.config} with random weights…"):
            loaded = load_random(request.config, request.load)
    else:
        loaded = load_with_feedback(request.model, request.load)
    engine = engine_with_feedback(loaded)
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
