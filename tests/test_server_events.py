"""The server answers every protocol from its own events (server/events.py): only the OpenAI
encoder shapes OpenAI's chunks, no module reads a stream back, and server/ has no import
circle. Then the encoders themselves, fed events by hand: the one grouping rule of blocks, and
the exact text each protocol streams for them."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import llmcli
from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.engine.reply import TOOL_CALL
from llmcli.engine.tools import ToolCall
from llmcli.engine.tools.reader import CallArguments, CallStart
from llmcli.server.anthropic import AnthropicEncoder
from llmcli.server.blocks import Blocks, Step
from llmcli.server.events import LOGPROBS, Ended, Failed, Outcome, Piece
from llmcli.server.ollama import OllamaEncoder
from llmcli.server.responses import ResponsesEncoder, Stored

SERVER = Path(llmcli.__file__).parent / "server"
# Modules of server/ that do not answer requests: a client of a running server, and the
# runtime records (each reads JSON of its own, not a stream the server made).
NOT_ANSWERING = {"client", "runtime", "process_check"}
# OpenAI's words: only openai.py writes them.
OPENAI_SHAPES = ("chat.completion", "text_completion", "[DONE]")
# Where JSON may be read at all: a request's body, and a call's arguments as the object they are.
READS_JSON = {("translate", "read_json"), ("events", "call_input")}


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(SERVER.glob("*.py"))}


def server_imports(tree: ast.Module) -> set[str]:
    """The server/ modules a module imports, wherever the import stands (TYPE_CHECKING and
    inside functions included): `from llmcli.server import x` names module x."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("llmcli.server.") and (SERVER / f"{name.split('.')[2]}.py").exists():
                found.add(name.split(".")[2])
    return found


def test_server_has_no_import_circle() -> None:
    graph = {name: server_imports(tree) - {name} for name, tree in modules().items()}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        for other in sorted(graph[name]):
            if other in path:
                circles.append(" → ".join([*path[path.index(other) :], other]))
            elif other not in done:
                visit(other, [*path, other])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not circles, "import circles in server/:\n" + "\n".join(sorted(set(circles)))
    assert not any("app" in imported for imported in graph.values()), "app.py composes: nothing imports it"


def test_only_the_openai_encoder_shapes_openai_chunks() -> None:
    wrong = []
    for name, tree in modules().items():
        if name in NOT_ANSWERING or name == "openai":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if any(shape in text for shape in OPENAI_SHAPES) or text.startswith("data: "):
                    wrong.append(f"{name}.py:{node.lineno} {text[:40]!r}")
    assert not wrong, "OpenAI's chunks shaped outside openai.py:\n" + "\n".join(wrong)


def test_no_server_module_reads_a_stream_back() -> None:
    """An encoder gets events; none parses another protocol's output (`json.loads` of an SSE
    line, a response's body_iterator)."""
    wrong = []
    for name, tree in modules().items():
        if name in NOT_ANSWERING:
            continue
        for function in [
            node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ]:
            for node in ast.walk(function):
                loads = isinstance(node, ast.Attribute) and node.attr == "loads"
                if loads and (name, function.name) not in READS_JSON:
                    wrong.append(f"{name}.py:{node.lineno} json.loads in {function.name}")
                if isinstance(node, ast.Attribute) and node.attr == "body_iterator":
                    wrong.append(f"{name}.py:{node.lineno} reads a response's body back")
    assert not wrong, "\n".join(wrong)


# The encoders, fed by hand.

STATS = SimpleNamespace(
    prompt_tokens=7,
    completion_tokens=5,
    cached_tokens=3,
    ttft_s=0.01,
    prefill_tok_s=700.0,
    decode_tok_s=250.0,
    prefilled_tokens=4,
    speculative=None,
)
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
PIECES = [
    Piece(0, REASONING, "Hmm"),
    Piece(0, REASONING, ", rain?"),
    Piece(0, CONTENT, ""),  # nothing to show: no block
    Piece(0, LOGPROBS, []),
    Piece(0, CONTENT, "Let me look."),
    Piece(0, TOOL_CALL, CallStart(0, "call_1", "get_weather")),
    Piece(0, TOOL_CALL, CallArguments(0, '{"city": ')),
    Piece(0, TOOL_CALL, CallArguments(0, '"Paris"}')),
    Piece(0, TOOL_CALL, CallStart(1, "call_2", "get_weather")),  # a call after a call: a block of its own
    Piece(0, TOOL_CALL, CallArguments(1, "{}")),
]


def outcome(finish_reason: str = "stop", calls: tuple[ToolCall, ...] = (CALL,)) -> Outcome:
    return Outcome("Let me look.", finish_reason, STATS, {}, "Hmm, rain?", 2, list(calls), stop_sequence=None)


def sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_blocks_group_pieces_by_one_rule() -> None:
    blocks = Blocks()
    steps = [blocks.feed(piece) for piece in PIECES]
    assert steps == [
        Step.NEW,
        Step.SAME,
        Step.SKIP,
        Step.SKIP,
        Step.NEW,
        Step.NEW,
        Step.SAME,
        Step.SAME,
        Step.NEW,
        Step.SAME,
    ]
    assert blocks.index == 3 and blocks.closes_one


def test_the_anthropic_encoder_streams_a_block_per_kind() -> None:
    encoder = AnthropicEncoder("tiny", [SimpleNamespace(ids=[1] * 7)])
    text = encoder.opening() + "".join(encoder.piece(piece) for piece in PIECES)
    text += encoder.ended(Ended(0, outcome())) + encoder.closing([outcome()])
    events = sse(text)
    assert text.startswith("event: message_start\ndata: {")
    assert [kind for kind, _ in events] == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 7,
        "output_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    starts = [data["content_block"] for kind, data in events if kind == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[2] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 7, "output_tokens": 5, "cache_read_input_tokens": 3},
    }
    cut = {"type": "error", "error": {"type": "api_error", "message": "cut"}}
    assert sse(encoder.failed(Failed("cut"))) == [("error", cut)]


def test_the_responses_encoder_numbers_every_event_and_stores_the_conversation() -> None:
    stored = Stored()
    shell = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    encoder = ResponsesEncoder(shell, [{"role": "user", "content": "Weather?"}], stored)
    text = encoder.opening() + "".join(encoder.piece(piece) for piece in PIECES)
    text += encoder.closing([outcome()])
    events = sse(text)
    assert [data["sequence_number"] for _, data in events] == list(range(1, len(events) + 1))
    added = [data["item"]["type"] for kind, data in events if kind == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    done = events[-1][1]["response"]
    assert events[-1][0] == "response.completed" and done["status"] == "completed"
    assert [item["status"] for item in done["output"]] == ["completed"] * 4
    assert done["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    said = stored["resp_1"].messages[-1]  # kept beside the response GET /v1/responses/{id} gives
    assert said["content"] == "Let me look." and [c["id"] for c in said["tool_calls"]] == ["call_1", "call_2"]


def test_the_ollama_encoder_sends_text_as_it_comes_and_calls_whole() -> None:
    encoder = OllamaEncoder("tiny", True, [])
    lines = [json.loads(line) for piece in PIECES for line in encoder.piece(piece).splitlines()]
    assert [line["message"] for line in lines] == [
        {"role": "assistant", "content": "", "thinking": "Hmm"},
        {"role": "assistant", "content": "", "thinking": ", rain?"},
        {"role": "assistant", "content": "Let me look."},
    ]
    last = json.loads(encoder.closing([outcome()]))
    assert last["done"] and last["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert last["done_reason"] == "stop" and last["eval_count"] == 5 and last["eval_duration"] == 20_000_000
    whole = encoder.whole([outcome("length", ())])
    assert whole["message"] == {"role": "assistant", "content": "Let me look.", "thinking": "Hmm, rain?"}
    assert whole["done_reason"] == "length" and whole["total_duration"] == 10_000_000 + 20_000_000
