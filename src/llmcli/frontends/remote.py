"""`generate` through a server: a running `llmcli serve` found by itself, or any OpenAI-compatible
endpoint named with --server. Same stdout, --json fields and exit codes as in-process, plus
`"server": URL`. Nothing here imports torch or transformers: that is the point of a warm server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import LoadSettings, SamplingSettings, SpeculativeSettings
from llmcli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from llmcli.frontends import terminal
from llmcli.server.client import Client

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat


@dataclass
class Target:
    client: Client
    model: str  # the name to send
    info: dict[str, Any] | None  # llmcli's /health; None for another kind of server


def find_server(
    model: str | None,
    load: LoadSettings,
    server: str | None,
    api_key: str | None,
    no_server: bool,
    speculative: SpeculativeSettings | None = None,
) -> Target | None:
    """The server to use, or None to load in-process. An explicit URL must answer; a discovered
    one that does not (hung, or gone since it wrote its record) is passed over quietly, and so
    is one without the draft model asked for."""
    if no_server:
        return None
    if server:
        client = Client(server, api_key)
        info = client.llmcli_health(timeout_s=5.0)
        name = model or (info["model"] if info else client.first_model())
        return Target(client, name, info)
    from llmcli.models.resolve import default_model_spec
    from llmcli.server.runtime import matching_server

    record = matching_server(model or default_model_spec(), load)
    if record is None or not _drafts_as_asked(record, speculative):
        return None
    client = Client(record["url"], api_key)
    info = client.llmcli_health(timeout_s=1.0)
    return Target(client, info["model"], info) if info else None


def _drafts_as_asked(record: dict[str, Any], speculative: SpeculativeSettings | None) -> bool:
    """Lookup is asked per request; drafting with a model needs the server to hold that model."""
    if speculative is None or speculative.method != "draft":
        return True
    return record.get("draft_model") == speculative.draft_model


def request_body(
    target: Target,
    sampling: SamplingSettings,
    speculative: SpeculativeSettings | None = None,
    output: OutputFormat | None = None,
) -> dict[str, Any]:
    fields = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # llmcli's extras: vLLM and llama.cpp's server read them too
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "max_tokens": sampling.max_new_tokens,
        "seed": sampling.seed,
        "stop": list(sampling.stop) or None,
    }
    body = {name: value for name, value in fields.items() if value is not None}
    if speculative is not None and target.info is not None:
        # llmcli's own extra field, sent only to an llmcli server (others would not know it).
        body["speculative"] = speculative.method
    if output is not None:
        body["response_format"] = response_format(output)
    return {"model": target.model, **body, "stream_options": {"include_usage": True}}


def response_format(output: OutputFormat) -> dict[str, Any]:
    """OpenAI's response_format for a constrained reply (any server that speaks it)."""
    from llmcli.engine.structured import ANY_OBJECT

    if output.schema == ANY_OBJECT:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "llmcli", "schema": output.schema, "strict": True}}


def parsed_value(text: str) -> tuple[bool, Any]:
    """(whether `text` is one whole JSON value, the value): a server's reply is checked here."""
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def run(
    target: Target,
    prompt: str,
    system: str | None,
    raw: bool,
    sampling: SamplingSettings,
    json_output: bool,
    stats: bool,
    out: Any,  # generate.StdoutSink
    speculative: SpeculativeSettings | None = None,
    output: OutputFormat | None = None,
) -> int:
    body = request_body(target, sampling, speculative, output)
    if raw:
        endpoint, body["prompt"] = "completions", prompt
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        endpoint, body["messages"] = "chat/completions", messages
    pieces: list[str] = []
    finish, usage, timings, resolved = "stop", {}, {}, None
    started = time.perf_counter()
    first_at = None
    exit_code = EXIT_OK
    events = target.client.stream(endpoint, body)
    try:
        for event in events:
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") if not raw else choice.get("text")
                if piece:
                    first_at = first_at or time.perf_counter()
                    pieces.append(piece)
                    if not json_output and not out.write(piece):
                        return EXIT_OK  # the reader left (`| head`): closing the stream stops the server
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
            resolved = event.get("sampling") or resolved
    except KeyboardInterrupt:
        finish, exit_code = "interrupted", EXIT_INTERRUPTED
    finally:
        events.close()  # a stream left early is a disconnect: the server stops generating
    text = "".join(pieces)
    ttft = timings.get("ttft_s", (first_at or started) - started)
    if json_output:
        info = target.info or {}
        record = {
            "text": text,
            "model": target.model,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "finish_reason": finish,
            "ttft_s": ttft,
            "prefill_tok_s": timings.get("prefill_tok_s"),
            "decode_tok_s": timings.get("decode_tok_s"),
            **{name: info.get(name) for name in _LOAD_FIELDS},
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "speculative": timings.get("speculative"),
            "sampling": resolved,
            "num_beams": 1,  # beam search runs in-process only
            "server": target.client.url,
        }
        if output is not None:
            record |= {"format": output.label, "value": parsed_value(text)[1]}
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif text and not text.endswith("\n"):
        out.write("\n")
    if output is not None and exit_code == EXIT_OK and not parsed_value(text)[0]:
        cause = "max_tokens cut it" if finish == "length" else f"the server ended it ({finish})"
        terminal.error(f"the reply is not a complete JSON value ({output.label}): {cause}")
        exit_code = EXIT_FAILURE
    if stats:
        terminal.note(
            f"{target.model} · {usage.get('prompt_tokens', '?')} prompt tok, "
            f"{usage.get('completion_tokens', '?')} completion tok · TTFT {ttft:.3f} s · "
            f"decode {timings.get('decode_tok_s', 0):.1f} tok/s · {finish} · server {target.client.url}"
        )
    return exit_code


_LOAD_FIELDS = (
    "weight_bytes",
    "device",
    "dtype",
    "quant",
    "quant_backend",
    "engine",
    "kv_bytes_per_token",
    "context_length",
)
