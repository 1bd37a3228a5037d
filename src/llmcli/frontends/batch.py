"""`llmcli generate --batch FILE`: many prompts, batched, results in input order.

The file holds one prompt per line, or JSON lines with a "prompt" (and an optional "system", and
an optional "schema": that reply is JSON valid under it, as with --json-schema);
"-" reads stdin. Output: each reply on its own line (replies may hold newlines: use --json, one
object per prompt, when a program reads the output). A summary with the aggregate tokens/s goes
to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import LoadSettings, SamplingParams, SamplingSettings
from llmcli.errors import EXIT_FAILURE, EXIT_OK, UsageError
from llmcli.frontends import terminal
from llmcli.frontends.formats import unfinished_value
from llmcli.frontends.loading import load_with_feedback

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.structured.constraint import Constraint
    from llmcli.models.load import LoadedModel


@dataclass(frozen=True)
class BatchItem:
    prompt: str
    system: str | None
    output: OutputFormat | None = None  # a JSON line's "schema", else --format / --json-schema


@dataclass(frozen=True)
class BatchRequest:
    path: str
    batch_size: int
    model: str | None
    system: str | None
    raw: bool
    json: bool
    sampling: SamplingSettings
    load: LoadSettings
    num_beams: int = 1  # > 1: each prompt on its own, by beam search
    output: OutputFormat | None = None  # --format json / --json-schema, for every line without its own


def read_items(
    path: str, default_system: str | None, default_output: OutputFormat | None = None
) -> list[BatchItem]:
    from llmcli.reading import BATCH_BYTES, decode, read_file, read_stream

    where = f"--batch {path}"
    if path == "-":
        text = decode(read_stream(sys.stdin.buffer, BATCH_BYTES, where), where)
    else:
        text = decode(read_file(path, BATCH_BYTES, where), where)
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except ValueError as error:
                raise UsageError(f"--batch {path}, line {number}: not valid JSON ({error.msg})") from error
            if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                raise UsageError(
                    f'--batch {path}, line {number}: a JSON line needs a non-empty "prompt" string'
                )
            output = default_output
            if "schema" in record:
                output = _line_schema(record["schema"], f"--batch {path}, line {number}")
            items.append(BatchItem(record["prompt"], record.get("system") or default_system, output))
        else:
            items.append(BatchItem(line, default_system, default_output))
    if not items:
        raise UsageError(f"--batch {path} holds no prompts")
    return items


def _line_schema(schema: object, where: str) -> OutputFormat:
    """A JSON line's own "schema", checked before the model loads."""
    from llmcli.engine.structured import OutputFormat, parse_schema
    from llmcli.engine.structured.grammar import check_format

    output = OutputFormat(parse_schema(schema, where), f"{where}: schema")
    check_format(output)
    return output


def run(request: BatchRequest) -> int:
    items = read_items(request.path, request.system, request.output)
    if request.num_beams > 1 and any(item.output for item in items):
        raise UsageError("--num-beams and a schema do not combine: beams are not constrained")
    # Loaded as generate loads it: the same weights give the same text. A GGUF file loaded
    # through transformers keeps its embedding table whole, where the lean load reads it from the
    # int8 head it is tied to, and greedy replies part after a few dozen tokens.
    loaded = load_with_feedback(request.model, request.load, lean=request.num_beams == 1)
    from llmcli.engine.conversation import build_messages, prompt_ids

    params = request.sampling.resolve(loaded.generation_config)
    prompts = [
        prompt_ids(loaded.tokenizer, build_messages(i.prompt, i.system), raw=request.raw) for i in items
    ]
    failed = False
    total_tokens = 0
    start = time.perf_counter()
    for first in range(0, len(items), request.batch_size):
        indices = range(first, min(first + request.batch_size, len(items)))
        fitting = [i for i in indices if len(prompts[i]) < loaded.context_length]
        if request.num_beams > 1:
            from llmcli.engine.beams import beam_search

            outcomes = [beam_search(loaded, prompts[i], params, request.num_beams) for i in fitting]
        else:
            constraints = [_constraint(loaded, items[i].output) for i in fitting]
            outcomes = _sampled(loaded, [prompts[i] for i in fitting], params, constraints)
        results = dict(zip(fitting, outcomes, strict=True))
        for index in indices:
            result = results.get(index)
            if result is None:
                failed = True
                _report_too_long(index, len(prompts[index]), loaded.context_length, request.json)
                continue
            total_tokens += result.stats.completion_tokens
            output = items[index].output
            if request.json:
                record = {
                    "index": index,
                    "text": result.text,
                    "prompt_tokens": result.stats.prompt_tokens,
                    "completion_tokens": result.stats.completion_tokens,
                    "finish_reason": result.finish_reason,
                }
                if output is not None:
                    value = json.loads(result.text) if result.value_complete else None
                    record |= {"format": output.label, "value": value}
                _write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                _write(result.text + "\n")
            if output is not None and not result.value_complete:
                failed = True
                tokens, limit = result.stats.completion_tokens, params.max_new_tokens
                why = unfinished_value(
                    output, result.finish_reason, tokens, limit, "--max-new-tokens", result.text
                )
                terminal.error(f"prompt {index}: {why}")
    seconds = time.perf_counter() - start
    rate = total_tokens / seconds if seconds else 0.0
    terminal.note(
        f"{len(items)} prompts in batches of up to {request.batch_size}: "
        f"{total_tokens} tokens in {seconds:.2f} s, {rate:.1f} tok/s aggregate"
    )
    return EXIT_FAILURE if failed else EXIT_OK


def _constraint(loaded: LoadedModel, output: OutputFormat | None) -> Constraint | None:
    if output is None:
        return None
    from llmcli.engine.structured.constraint import Constraint

    return Constraint(output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)


def _sampled(
    loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, constraints: list[Any]
) -> list[Any]:
    """One batch decoded together (the loop's sampling, per row; a grammar per row, if any)."""
    from llmcli.engine.batch import generate_batch
    from llmcli.engine.choose import runs_natively

    if not prompts:
        return []
    return generate_batch(
        loaded.model,
        loaded.tokenizer,
        prompts,
        params,
        loaded.eos_token_ids,
        loaded.context_length,
        static_cache=bool(loaded.fast),
        constraints=constraints,
        native=runs_natively(loaded),
    )


def _report_too_long(index: int, tokens: int, context: int, as_json: bool) -> None:
    message = f"prompt {index + 1} is {tokens} tokens; the context holds {context}"
    if as_json:
        _write(json.dumps({"index": index, "error": message}) + "\n")
    else:
        terminal.error(message)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
