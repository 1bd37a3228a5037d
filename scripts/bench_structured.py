"""Constrained decoding (--json-schema) on this machine: what it costs per token, what a schema
costs to compile, and how often the demo model's replies validate with and without it.

  python scripts/bench_structured.py                 # the demo model on this CPU
  python scripts/bench_structured.py --config configs/llama-3.2-1b.json --tokenizer DIR --device cuda

1. Schema compile: a 20-property schema, cold (a schema not seen before in this process) and
   cached (the same schema again), median of 5.
2. Per-token cost: 20 extraction prompts, greedy, each run with and without the schema, the runs
   interleaved. Reported: decode ms/token of each, and the time spent in the constraint itself
   (the mask and following the chosen token), per token, as a share of an unconstrained step.
3. Validity (real weights only): how many of the 20 replies parse and validate with the schema,
   with and without it ("without": the prompt asks for the same JSON; counted as-is, and after
   taking the outermost {...} out of code fences or prose).
With --config (random weights) only 1 and 2 are measured, on random prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.conversation import build_messages, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.engine.structured import OutputFormat
from llmcli.engine.structured.constraint import Constraint
from llmcli.engine.structured.grammar import check_format

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez, 34, works as a nurse in Madrid.",
    "Born 52 years ago, Kenji Tanaka now teaches physics in Osaka.",
    "Our new hire is Ahmed Khan (28), a software engineer based in Toronto.",
    "Grace Miller is a 45-year-old lawyer who lives in Chicago.",
    "The baker from Lyon, Pierre Durand, just turned 61.",
    "At 19, Lena Schmidt studies architecture in Berlin.",
    "Carlos Silva, a 38-year-old chef, runs a restaurant in Lisbon.",
    "Priya Patel (41) is a doctor at a hospital in Mumbai.",
    "Tom Becker drives a taxi in Hamburg; he is 57.",
    "Sofia Rossi, 23, is a graphic designer from Milan.",
    "Meet Olu Adeyemi, 33, an accountant living in Lagos.",
    "Anna Kowalska works as a pharmacist in Warsaw. She is 47.",
    "James O'Brien, aged 66, is a retired pilot in Dublin.",
    "Yuki Sato is a 29-year-old journalist in Tokyo.",
    "Fatima Zahra, 36, manages a bookshop in Casablanca.",
    "Liam Nguyen, a 24-year-old barista, lives in Melbourne.",
    "Elena Petrova (50) is a violinist with the orchestra in Moscow.",
    "Mohammed Ali, 31, is an electrician in Cairo.",
    "Isabel Garcia, 58, is a school principal in Mexico City.",
    "Noah Williams is a 42-year-old firefighter in Denver.",
]
INSTRUCTION = (
    "Extract the person's name, age, city and occupation from this text. Reply with only a JSON "
    'object with the keys "name", "age", "city" and "occupation".\n\nText: '
)


def twenty_properties(tag: str) -> dict:
    kinds = [
        {"type": "string", "maxLength": 30},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["a", "b", "c"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
    ]
    properties = {f"{tag}_{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": properties, "required": list(properties)[:10]}


def compile_times() -> tuple[float, float]:
    cold, cached = [], []
    for run in range(5):
        output = OutputFormat(twenty_properties(f"p{run}"), "bench")
        start = time.perf_counter()
        check_format(output)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        check_format(output)
        cached.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(cached)


class TimedConstraint(Constraint):
    """The constraint, with the time spent in it counted."""

    seconds = 0.0

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return super().mask(logits)
        finally:
            TimedConstraint.seconds += time.perf_counter() - start

    def advance(self, token_id: int) -> None:
        start = time.perf_counter()
        try:
            super().advance(token_id)
        finally:
            TimedConstraint.seconds += time.perf_counter() - start


def run_one(engine: Engine, loaded, ids: list[int], tokens: int, output: OutputFormat | None):
    constraint = None
    if output is not None:
        constraint = TimedConstraint(output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    engine.reset()
    return engine.complete(
        ids, SamplingParams(temperature=0.0, max_new_tokens=tokens), loaded.tokenizer, constraint
    )


def lenient(text: str) -> object:
    start, end = text.find("{"), text.rfind("}")
    return json.loads(text[start : end + 1])


def valid(text: str, parse) -> bool:
    import jsonschema

    try:
        jsonschema.validate(parse(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="Random weights from this config (with --tokenizer).")
    parser.add_argument("--tokenizer", help="A tokenizer folder for --config.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("-n", "--tokens", type=int, default=80)
    args = parser.parse_args()
    settings = LoadSettings(device=args.device)
    if args.config:
        from dataclasses import replace

        from transformers import AutoTokenizer

        from llmcli.models.load import load_random

        loaded = replace(
            load_random(args.config, settings), tokenizer=AutoTokenizer.from_pretrained(args.tokenizer)
        )
    else:
        from llmcli.models.load import load_model
        from llmcli.models.resolve import demo_gguf_path, resolve_model

        loaded = load_model(resolve_model(str(demo_gguf_path())), settings)
    engine = Engine.for_loaded(loaded)
    engine.warm_up()
    cold, cached = compile_times()
    print(
        f"{loaded.name} · {loaded.device} · {loaded.dtype_name} · quant {loaded.quant} · engine {engine.name}"
    )
    print(
        f"schema compile, 20 properties: cold {cold * 1000:.2f} ms, "
        f"cached {cached * 1000:.3f} ms (median of 5)"
    )
    output = OutputFormat(PERSON, "person")
    if args.config:
        vocab = loaded.vocab_size
        prompts = [
            torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(20)
        ]
        # Random text would not stop; any object keeps the value open as long as it likes.
        output = OutputFormat({"type": "object"}, "any object")
    else:
        prompts = [prompt_ids(loaded.tokenizer, build_messages(INSTRUCTION + text)) for text in TEXTS]
    run_one(engine, loaded, prompts[0], 8, output)  # warm-up: the tokenizer's grammar view, kernels
    run_one(engine, loaded, prompts[0], 8, None)
    free, bound, spent, bound_tokens, free_tokens = [], [], 0.0, 0, 0
    texts_free, texts_bound = [], []
    for ids in prompts:
        TimedConstraint.seconds = 0.0
        with_schema = run_one(engine, loaded, ids, args.tokens, output)
        spent += TimedConstraint.seconds
        bound_tokens += with_schema.stats.completion_tokens
        without = run_one(engine, loaded, ids, args.tokens, None)
        free_tokens += without.stats.completion_tokens
        if with_schema.stats.decode_tok_s:
            bound.append(1 / with_schema.stats.decode_tok_s)
        if without.stats.decode_tok_s:
            free.append(1 / without.stats.decode_tok_s)
        texts_bound.append(with_schema.text)
        texts_free.append(without.text)
    step_free, step_bound = statistics.median(free), statistics.median(bound)
    per_token = spent / max(bound_tokens, 1)
    print()
    print("| | decode ms/token | tok/s | tokens |")
    print("|---|---:|---:|---:|")
    print(f"| without a schema | {step_free * 1000:.2f} | {1 / step_free:.1f} | {free_tokens} |")
    print(f"| with the schema | {step_bound * 1000:.2f} | {1 / step_bound:.1f} | {bound_tokens} |")
    print()
    print(
        f"time in the constraint: {per_token * 1e6:.0f} µs per token = {100 * per_token / step_free:.1f} % "
        f"of an unconstrained step; decode ms/token {100 * (step_bound / step_free - 1):+.1f} % "
        "(median per prompt)"
    )
    if not args.config:
        strict = sum(valid(text, json.loads) for text in texts_free)
        loose = sum(valid(text, lenient) for text in texts_free)
        constrained = sum(valid(text, json.loads) for text in texts_bound)
        print(
            f"valid under the schema, of {len(TEXTS)}: with --json-schema {constrained}; without it "
            f"{strict} as printed, {loose} after cutting out the outermost {{…}}"
        )


if __name__ == "__main__":
    main()
