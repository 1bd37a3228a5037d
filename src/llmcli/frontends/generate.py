"""One-shot generation: prompt from arguments and/or stdin, text or JSON to stdout.

Prompt layout when both are given: the arguments are the instruction and stdin the material,
joined as "<arguments>\n\n<stdin>". Either alone is the whole prompt.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from llmcli.config.settings import LoadSettings, SamplingSettings, SpeculativeSettings
from llmcli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, LlmcliError, UsageError
from llmcli.frontends import terminal
from llmcli.frontends.loading import engine_with_feedback, load_with_feedback, speculation_with_feedback

if TYPE_CHECKING:
    from llmcli.engine.loop import GenerationResult
    from llmcli.engine.structured import OutputFormat


@dataclass(frozen=True)
class GenerateRequest:
    prompt_words: tuple[str, ...]
    model: str | None
    system: str | None
    raw: bool
    json: bool
    stats: bool
    sampling: SamplingSettings
    load: LoadSettings
    server: str | None = None  # --server / LLMCLI_SERVER: use this OpenAI-compatible endpoint
    api_key: str | None = None
    no_server: bool = False  # --no-server: never use a running `llmcli serve`
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    num_beams: int = 1  # > 1: beam search, printed when it ends
    output: OutputFormat | None = None  # --format json / --json-schema: a JSON value, constrained


def read_stdin(stream: BinaryIO | None) -> str:
    """All of stdin as text, or '' when it is a terminal or closed (we never wait for typing)."""
    if stream is None or stream.isatty():
        return ""
    data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"stdin is not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start})",
            "convert it first, e.g. with `iconv -t UTF-8`",
        ) from err


def assemble_prompt(words: tuple[str, ...], stdin_text: str) -> str:
    instruction = " ".join(words).strip()
    material = stdin_text.strip()
    prompt = "\n\n".join(part for part in (instruction, material) if part)
    if not prompt:
        raise UsageError(
            "nothing to generate from: the prompt is empty",
            'give it as arguments (llmcli generate "…") or on stdin (echo "…" | llmcli generate)',
        )
    return prompt


def run(request: GenerateRequest) -> int:
    """Resolve, load, generate, print. Returns the exit code; raises LlmcliError on failure."""
    stdin = sys.stdin.buffer if sys.stdin is not None else None
    prompt = assemble_prompt(request.prompt_words, read_stdin(stdin))
    from llmcli.frontends import remote

    in_process = request.no_server or request.num_beams > 1  # beams run on the loaded model itself
    target = remote.find_server(
        request.model, request.load, request.server, request.api_key, in_process, request.speculative
    )
    if target is not None:
        out = StdoutSink()
        return remote.run(
            target,
            prompt,
            request.system,
            request.raw,
            request.sampling,
            request.json,
            request.stats,
            out,
            request.speculative,
            request.output,
        )

    loaded = load_with_feedback(request.model, request.load)
    from llmcli.engine.conversation import build_messages, prompt_ids

    ids = prompt_ids(loaded.tokenizer, build_messages(prompt, request.system), raw=request.raw)
    params = request.sampling.resolve(loaded.generation_config)
    out = StdoutSink()
    exit_code = EXIT_OK
    if request.num_beams > 1:
        from llmcli.engine.beams import beam_search

        engine_name = "transformers (beam search)"
        with terminal.status(f"Searching with {request.num_beams} beams…"):
            result = beam_search(loaded, ids, params, request.num_beams)
        if not request.json and not out.write(result.text):
            return EXIT_OK
    else:
        engine = engine_with_feedback(loaded)
        engine_name = engine.name
        engine.speculation = speculation_with_feedback(
            loaded, request.model, request.speculative, request.load
        )
        constraint = None
        if request.output is not None:
            from llmcli.engine.structured.constraint import Constraint

            constraint = Constraint(request.output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        generation = engine.generate(ids, params, loaded.tokenizer, constraint)
        try:
            for piece in generation:
                if not request.json and not out.write(piece):
                    return EXIT_OK  # the reader left (`| head`): stop generating, quietly
        except KeyboardInterrupt:
            generation.interrupt()
            exit_code = EXIT_INTERRUPTED
        result = generation.result
    if request.json:
        record = {
            "text": result.text,
            "model": loaded.name,
            "prompt_tokens": result.stats.prompt_tokens,
            "completion_tokens": result.stats.completion_tokens,
            "finish_reason": result.finish_reason,
            "ttft_s": round(result.stats.ttft_s, 6),
            "prefill_tok_s": round(result.stats.prefill_tok_s, 3),
            "decode_tok_s": round(result.stats.decode_tok_s, 3),
            "weight_bytes": loaded.weight_bytes,
            "device": str(loaded.device),
            "dtype": loaded.dtype_name,
            "quant": loaded.quant,
            "quant_backend": loaded.quant_backend,
            "engine": engine_name,
            "num_beams": request.num_beams,
            "kv_bytes_per_token": loaded.kv_bytes_per_token,
            "context_length": loaded.context_length,
            "cached_tokens": result.stats.cached_tokens,
            "speculative": result.stats.speculative.as_dict() if result.stats.speculative else None,
            "sampling": params.as_dict(),
            **record_extras(result, request.output),
        }
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif result.text and not result.text.endswith("\n"):
        out.write("\n")
    if request.output is not None and exit_code == EXIT_OK and not result.value_complete:
        from llmcli.engine.structured import unfinished_value

        stats = result.stats
        terminal.error(
            unfinished_value(
                request.output,
                result.finish_reason,
                stats.completion_tokens,
                params.max_new_tokens,
                "--max-new-tokens",
            )
        )
        exit_code = EXIT_FAILURE
    if request.stats:
        terminal.note(
            f"{loaded.name} · {result.stats.summary()} · {result.finish_reason} · {loaded.memory_summary()}"
            f" · engine {engine_name}"
        )
    return exit_code


def record_extras(result: GenerationResult, output: OutputFormat | None) -> dict[str, Any]:
    """--json's fields for constrained output: the format asked for, and the value (parsed; null
    when the reply was cut before the value was complete)."""
    if output is None:
        return {}
    value = None
    if result.value_complete:
        with contextlib.suppress(ValueError):  # the grammar guarantees it; never crash on it
            value = json.loads(result.text)
    return {"format": output.label, "value": value}


class StdoutSink:
    """Writes to stdout at once; a reader that went away is not an error but a reason to stop."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, text: str) -> bool:
        if self.closed:
            return False
        if sys.stdout is None:  # started with stdout closed (`>&-`): nobody reads; end quietly
            self.closed = True
            return False
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as error:
            self.closed = True
            terminal.detach_stdout()
            if error.errno == errno.ENOSPC:  # `>/dev/full`, a full disk: the output is lost
                raise LlmcliError(f"cannot write the output: {os.strerror(error.errno)}") from None
            return False  # the reader went away (`| head`), or stdout is not writable
        return True
