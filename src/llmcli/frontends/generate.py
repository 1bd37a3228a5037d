"""One-shot generation: prompt from arguments and/or stdin, text or JSON to stdout.

Prompt layout when both are given: stdin is the material and the arguments the instruction,
joined as "<stdin>\n\n<arguments>" (as simonw's `llm` does). The material first: two questions
about one document then share the document's tokens, which the prefix cache (in memory, and on
disk from one process to the next) does not prefill again. Either alone is the whole prompt.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from llmcli.config.settings import LoadSettings, RemoteSettings, SamplingSettings, SpeculativeSettings
from llmcli.engine.reasoning import REASONING
from llmcli.engine.reply import TOOL_CALL
from llmcli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, LlmcliError, UsageError
from llmcli.frontends import terminal
from llmcli.frontends.json_record import json_record
from llmcli.frontends.opening import open_target
from llmcli.frontends.target import Ask
from llmcli.frontends.tools import call_record

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolRequest
    from llmcli.models.vision.encoder import ImageInput


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
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    num_beams: int = 1  # > 1: beam search, printed when it ends
    output: OutputFormat | None = None  # --format json / --json-schema: a JSON value, constrained
    think: str | None = None  # show, hide, off; None: show on a terminal, hide in a pipe
    think_budget: int | None = None  # thinking tokens at most (in-process: a server has no budget)
    tools: ToolRequest | None = None  # --tools, read already
    tools_from_stdin: bool = False  # --tools -: stdin held the tools, not the prompt
    images: tuple[str, ...] = ()  # --image: paths, or - for stdin


def read_stdin(stream: BinaryIO | None) -> str:
    """All of stdin as text, or '' when it is a terminal or closed (we never wait for typing)."""
    from llmcli.reading import PROMPT_BYTES, decode, read_stream

    if stream is None or stream.isatty():
        return ""
    return decode(read_stream(stream, PROMPT_BYTES, "stdin"), "stdin")


def read_images(paths: tuple[str, ...], stdin: BinaryIO | None) -> list[ImageInput]:
    """--image's files (- : stdin, once), read and size-checked; decoded later, where the
    model's processor takes them (a bad image is refused before anything is prefilled)."""
    from llmcli.models.vision.encoder import ImageInput
    from llmcli.models.vision.image_file import read_image_file

    if paths.count("-") > 1:
        raise UsageError("--image - reads stdin, which holds one image: give it once")
    images = []
    for path in paths:
        if path != "-":
            images.append(read_image_file(path))
            continue
        if stdin is None or stdin.isatty():
            raise UsageError("--image - reads an image from stdin, and stdin is a terminal: pipe one in")
        from llmcli.models.vision.image_file import IMAGE_BYTES
        from llmcli.reading import read_stream

        images.append(ImageInput(read_stream(stdin, IMAGE_BYTES, "stdin"), "stdin"))
    return images


def assemble_prompt(words: tuple[str, ...], stdin_text: str) -> str:
    instruction = " ".join(words).strip()
    material = stdin_text.strip()
    prompt = "\n\n".join(part for part in (material, instruction) if part)
    if not prompt:
        raise UsageError(
            "nothing to generate from: the prompt is empty",
            'give it as arguments (llmcli generate "…") or on stdin (echo "…" | llmcli generate)',
        )
    return prompt


def run(request: GenerateRequest) -> int:
    """Find the target, generate, print. Returns the exit code; raises LlmcliError on failure."""
    stdin = sys.stdin.buffer if sys.stdin is not None else None
    images = read_images(request.images, stdin)
    stdin_text = "" if request.tools_from_stdin or "-" in request.images else read_stdin(stdin)
    prompt = assemble_prompt(request.prompt_words, stdin_text)
    # Beam search and a thinking budget run on the loaded model itself.
    in_process = request.num_beams > 1 or request.think_budget is not None
    target = open_target(
        request.model,
        request.load,
        request.remote,
        request.speculative,
        in_process,
        lean=request.num_beams == 1,  # beam search runs on a transformers model
    )
    content: str | list[dict[str, Any]] = prompt
    if images:  # before the text, as the models' own examples place them
        content = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": prompt}]
    messages = [{"role": "user", "content": content}]
    if request.system:
        messages.insert(0, {"role": "system", "content": request.system})
    method, output = request.speculative.method, request.output
    think = request.think or ("show" if terminal.stderr_is_terminal() else "hide")
    ask = Ask(
        messages,
        request.sampling,
        method,
        output,
        request.raw,
        request.num_beams,
        think == "off",
        request.think_budget,
        request.tools,
    )
    reply = target.reply(ask)
    out = StdoutSink()
    thinking = terminal.Thinking(shown=think == "show" and not request.json)
    exit_code = EXIT_OK
    broken: LlmcliError | None = None
    try:
        for channel, piece in reply:
            if channel == REASONING:
                thinking.write(piece)  # stderr, dimmed: stdout carries the answer only
                continue
            if channel == TOOL_CALL:
                continue  # a call's parts: the whole calls are printed at the end, one line each
            thinking.end()
            if not request.json and not out.write(piece):
                reply.interrupt()
                return EXIT_OK  # the reader left (`| head`): stop generating, quietly
    except KeyboardInterrupt:
        reply.interrupt()
        exit_code = EXIT_INTERRUPTED
    except LlmcliError as error:  # the reply broke off (a server that stopped): what came stays
        broken = error
    thinking.end()
    outcome = reply.outcome()
    if broken is not None:
        outcome.finish_reason = "error"
    if request.json:
        record = json_record(target, outcome, request.num_beams, output, request.tools is not None)
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        if outcome.text and not outcome.text.endswith("\n"):
            out.write("\n")
        for call in outcome.tool_calls:  # one JSON line each, after the text
            out.write(json.dumps(call_record(call), ensure_ascii=False) + "\n")
    if output is not None and exit_code == EXIT_OK and broken is None and not outcome.value_complete:
        from llmcli.frontends.formats import unfinished_value

        limit = (outcome.sampling or {}).get("max_new_tokens")
        tokens = outcome.completion_tokens
        terminal.error(
            unfinished_value(output, outcome.finish_reason, tokens, limit, "--max-new-tokens", outcome.text)
        )
        exit_code = EXIT_FAILURE
    if request.stats:
        summary = f"{outcome.stats_summary()} · {outcome.finish_reason} · {target.summary()}"
        terminal.note(f"{target.name} · {summary}")
    if broken is not None:
        raise broken  # one line on stderr, exit 1, after what came (and its --json record)
    return exit_code


class StdoutSink:
    """Writes to stdout at once; a reader that went away is not an error but a reason to stop.
    On a terminal, no control character in the text acts (terminal.inert); a pipe gets it as is."""

    def __init__(self) -> None:
        self.closed = False
        self._inert = terminal.stdout_is_terminal()

    def write(self, text: str) -> bool:
        if self.closed:
            return False
        if sys.stdout is None:  # started with stdout closed (`>&-`): nobody reads; end quietly
            self.closed = True
            return False
        try:
            sys.stdout.write(terminal.inert(text) if self._inert else text)
            sys.stdout.flush()
        except OSError as error:
            self.closed = True
            terminal.detach_stdout()
            if error.errno == errno.ENOSPC:  # `>/dev/full`, a full disk: the output is lost
                raise LlmcliError(f"cannot write the output: {os.strerror(error.errno)}") from None
            return False  # the reader went away (`| head`), or stdout is not writable
        return True
