"""Custom tools with a grammar (Codex CLI's apply_patch): the input a model writes inside its
call's JSON string is held to the tool's Lark grammar, checked here against the grammar itself by
llguidance's own matcher on the raw text (the `lark` package is not installed); the call comes
back through the official client as a custom_tool_call item, streamed and not; its output on the
next turn reaches the prompt; a grammar that cannot be used is a 400 naming the tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmcli.config.settings import LoadSettings
from llmcli.engine.loop import Engine
from llmcli.engine.structured.grammar import guidance_tokenizer
from llmcli.engine.tools import ToolRequest
from llmcli.engine.tools.freeform import Freeform, input_so_far, json_escaped
from llmcli.engine.tools.offered import parse_tools
from llmcli.errors import UsageError
from test_tools import FAMILIES, ask_with_tools

from test_serve import Server
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL

openai = pytest.importorskip("openai")

# Codex CLI's own grammar for its apply_patch tool, as it declares it (see the file's header).
APPLY_PATCH = (Path(__file__).parent / "data" / "apply_patch.lark").read_text()
# Small enough for a random model to finish, and holding what JSON escapes: a tab, a newline, a
# quote and a backslash.
ENTRIES = r"""start: entry+ "END" LF
entry: ("+" | "-") NAME (TAB NAME)? LF
NAME: /[a-z"\\]{1,6}/
TAB: "\t"
LF: "\n"
"""
PATCH = (
    '*** Begin Patch\n*** Add File: notes/a "b".txt\n+tab\there, back\\slash, "quoted", ünï 😀\n'
    "*** Update File: src/app.py\n*** Move to: src/main.py\n@@ def main():\n-    print('hi')\n"
    '+    print("hello\\n")\n \n*** Delete File: old.txt\n*** End Patch\n'
)
NOT_PATCHES = [
    "*** Begin Patch\n*** Add File: a.txt\nno plus sign\n*** End Patch\n",
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Add File: a.txt\n+x\n*** End Patch\n",  # no begin
    "*** Begin Patch\n*** Add File: a\nb.txt\n+x\n*** End Patch\n",  # a newline inside a name
]


def custom(name: str, grammar: str | None, syntax: str = "lark") -> dict:
    """A custom tool as Chat Completions writes it (the shape parse_tools takes)."""
    form = (
        {"type": "text"}
        if grammar is None
        else {"type": "grammar", "grammar": {"syntax": syntax, "definition": grammar}}
    )
    return {"type": "custom", "custom": {"name": name, "description": "Edit files.", "format": form}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """A random tiny model whose context holds the apply_patch grammar the tool's description
    carries (1,024 tokens would not, with a 400-token vocabulary)."""
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    folder = build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-custom", "llama", added=ADDED, special=SPECIAL
    )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    loaded = load_model(resolve_model(str(folder)), LoadSettings(device="cpu", dtype="fp32", threads=1))
    return loaded, Engine.for_loaded(loaded)


def matcher(loaded, lark: str):
    from llguidance import LLMatcher

    guidance = guidance_tokenizer(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    found = LLMatcher(guidance, lark, log_level=0)
    assert not found.is_error(), found.get_error()
    return found


def accepts(loaded, lark: str, text: str, whole: bool = True) -> bool:
    """Whether `text` is in the grammar (`whole`), or the start of a text in it."""
    found = matcher(loaded, lark)
    for token in loaded.tokenizer.encode(text, add_special_tokens=False):
        if not found.consume_token(token):
            return False
    return found.is_accepting() if whole else not found.is_error()


def cut_input(answer: str) -> str:
    """The raw input of a call the length limit cut (given back as the text it was)."""
    return input_so_far(answer[answer.index('{"input": ') :])


def test_the_escaped_grammar_holds_exactly_the_escaped_texts_of_codexs_apply_patch(model) -> None:
    loaded = model[0]
    escaped = Freeform("lark", APPLY_PATCH).escaped_lark()
    assert accepts(loaded, APPLY_PATCH, PATCH)  # the raw grammar's own verdicts, as references
    assert accepts(loaded, escaped, json_escaped(PATCH))
    assert not accepts(loaded, escaped, PATCH)  # a raw newline cannot stand in a JSON string
    for text in NOT_PATCHES:
        assert not accepts(loaded, APPLY_PATCH, text)
        assert not accepts(loaded, escaped, json_escaped(text)), text


@pytest.mark.parametrize(
    ("regex", "inside", "outside"),
    [
        (r"^[a-z]+\d{2}$", ["abc12"], ["ab1", "abc123"]),
        (r"(?s)a.b", ["a\nb", 'a"b', "a\\b", "a\x01b"], ["ab", "a\n\nb"]),
        (r"[^x]+", ['\n"\x01\\y'], ["axb"]),
        (r"(a|\n){2,3}", ["a\n", "\n\na"], ["a", "a\na\n"]),
        (r"[\n\t]+x", ["\n\tx"], ["ax", "x"]),
        (r"[\u00e9\U0001F600-\U0001F64F]+", ["é😀"], ["e"]),
        (r"a|", ["", "a"], ["b"]),
    ],
)
def test_a_regex_format_holds_its_escaped_texts(model, regex: str, inside: list, outside: list) -> None:
    lark = Freeform("regex", regex).escaped_lark()
    for text in inside:
        assert accepts(model[0], lark, json_escaped(text)), text
    for text in outside:
        assert not accepts(model[0], lark, json_escaped(text)), text


def test_a_forced_custom_call_parses_under_its_grammar_in_every_family(model) -> None:
    """A random model, forced to call the tool: whatever it writes, the raw input of every call
    it finishes is in the grammar, and a call the length limit cut is the start of one."""
    loaded = model[0]
    tools = parse_tools([custom("edit", ENTRIES)], "tools", custom=True)
    finished = 0
    for family in FAMILIES:
        for seed in range(3):
            _, answer, calls, result = ask_with_tools(
                model, family, ToolRequest(tools, "edit", False), seed, max_new=300
            )
            for call in calls:
                assert call.name == "edit"
                assert accepts(loaded, ENTRIES, json.loads(call.arguments)["input"]), call.arguments
            if result.finish_reason == "length":  # the cut call is given back as text
                assert accepts(loaded, ENTRIES, cut_input(answer), whole=False), answer
            finished += len(calls)
    assert finished >= 10  # most replies end (the grammar lets END come after any entry)


def test_without_the_grammar_the_same_model_writes_no_such_input(model) -> None:
    """The check above can fail: offered as free text, the same calls' inputs are not entries."""
    tools = parse_tools([custom("edit", None)], "tools", custom=True)
    inputs = []
    for seed in range(3):
        _, _, calls, _ = ask_with_tools(model, "hermes", ToolRequest(tools, "edit", False), seed, max_new=300)
        inputs += [json.loads(call.arguments)["input"] for call in calls]
    assert inputs and not any(accepts(model[0], ENTRIES, text) for text in inputs)


def test_apply_patch_input_stays_a_patch_however_far_a_random_model_gets(model) -> None:
    """A random model rarely ends a line, so it rarely finishes a patch: every token it writes
    keeps the raw input the start of a patch."""
    tools = parse_tools([custom("apply_patch", APPLY_PATCH)], "tools", custom=True)
    for family in ("hermes", "llama3", "harmony"):
        _, answer, calls, _ = ask_with_tools(
            model, family, ToolRequest(tools, "apply_patch", False), 0, max_new=200
        )
        raw = json.loads(calls[0].arguments)["input"] if calls else cut_input(answer)
        assert raw.startswith("*** Begin Patch\n"), answer
        assert accepts(model[0], APPLY_PATCH, raw, whole=False), raw


def test_function_and_custom_calls_share_one_reply_grammar(model) -> None:
    """Codex offers both: each kind of call is allowed, each held to its own form."""
    from llmcli.engine.structured.constraint import Constraint
    from llmcli.engine.tools.turn import tool_turn

    loaded = model[0]
    loaded.tokenizer.chat_template = HERMES_TEMPLATE
    shell = {"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}  # fmt: skip
    tools = parse_tools([shell, custom("apply_patch", APPLY_PATCH)], "tools", custom=True)
    turn = tool_turn(loaded.tokenizer, [{"role": "user", "content": "hi"}], ToolRequest(tools, "required"),
                     loaded.vocab_size, loaded.eos_token_ids)  # fmt: skip

    def allowed(call: dict) -> bool:
        constraint = Constraint(turn.output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        text = "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
        for token in loaded.tokenizer.encode(text, add_special_tokens=False):
            if not constraint._matcher.consume_token(token):
                return False
        return constraint.complete

    assert allowed({"name": "shell", "arguments": {"cmd": "ls"}})
    assert allowed({"name": "apply_patch", "arguments": {"input": PATCH}})
    assert not allowed({"name": "apply_patch", "arguments": {"input": NOT_PATCHES[0]}})
    assert not allowed({"name": "shell", "arguments": {"input": PATCH}})


@pytest.mark.parametrize(
    ("syntax", "grammar", "words"),
    [
        ("lark", "start: /unclosed", "tool 'edit': its Lark grammar"),
        ("lark", 'start: "a" missing', "tool 'edit': its Lark grammar"),
        ("lark", 'start: "a"\n%ignore " "', "%ignore cannot be used in a custom tool's grammar"),
        ("lark", 'start: %json {"type": "object"}', "%json cannot be used"),
        ("lark", 'start: "yes"i', "case-insensitive literal"),
        ("regex", "(?i)yes", "(?i) cannot be used"),
        ("regex", r"(a)\1", "a back-reference cannot be used"),
        ("regex", "[[:alpha:]]", "Possible nested set"),  # Python's reading would differ from Rust's
    ],
)
def test_a_grammar_that_cannot_be_used_is_one_line_naming_the_tool(
    syntax: str, grammar: str, words: str
) -> None:
    with pytest.raises(UsageError) as refused:
        parse_tools([custom("edit", grammar, syntax)], "tools", custom=True)
    message = str(refused.value)
    assert message.startswith("tools: tool 'edit': ") and words in message and "\n" not in message


def test_custom_tools_are_refused_where_their_calls_cannot_be_answered() -> None:
    with pytest.raises(UsageError, match="custom tools are not supported here"):
        parse_tools([custom("edit", ENTRIES)], "tools")


# ---- through the server, with the official client -----------------------------------------

TOOL = {
    "type": "custom",
    "name": "edit",
    "description": "Edit entries.",
    "format": {"type": "grammar", "syntax": "lark", "definition": ENTRIES},
}


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server


def test_a_custom_call_comes_back_as_a_custom_tool_call_streamed_and_not(server: Server, model) -> None:
    client = server.client()
    asked = dict(
        model="tiny", input="Add an entry.", tools=[TOOL], tool_choice={"type": "custom", "name": "edit"},
        max_output_tokens=300, temperature=0,
    )  # fmt: skip
    response = client.responses.create(**asked)
    (call,) = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "edit" and call.call_id
    assert accepts(model[0], ENTRIES, call.input), call.input
    with client.responses.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [event.delta for event in events if event.type == "response.custom_tool_call_input.delta"]
    (done,) = [event for event in events if event.type == "response.custom_tool_call_input.done"]
    streamed = [item for item in final.output if item.type == "custom_tool_call"]
    assert "".join(deltas) == done.input == streamed[0].input == call.input
    follow = client.responses.create(
        model="tiny", previous_response_id=response.id, tools=[TOOL], max_output_tokens=2,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "added"}],
    )  # fmt: skip
    assert follow.usage.input_tokens > response.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the stored turn, call and all, reused


def test_a_custom_calls_output_is_taken_on_the_next_turn_and_reaches_the_prompt(server: Server) -> None:
    client = server.client()

    def follow(output: str | list):
        history = [
            {"role": "user", "content": "Add an entry."},
            {"type": "custom_tool_call", "call_id": "call_1", "name": "edit", "input": '+ab\tc"d\nEND\n'},
            {"type": "custom_tool_call_output", "call_id": "call_1", "output": output},
        ]
        return client.responses.create(
            model="tiny", input=history, tools=[TOOL], max_output_tokens=2, store=False
        )

    short, long = follow("done"), follow("done: " + "the entry was added to the list " * 4)
    assert long.usage.input_tokens - short.usage.input_tokens >= 20
    parts = follow([{"type": "input_text", "text": "do"}, {"type": "input_text", "text": "ne"}])
    assert parts.usage.input_tokens == short.usage.input_tokens  # Codex's parts: their text
    with pytest.raises(openai.BadRequestError, match="input_image parts are not supported"):
        follow([{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}])


def test_a_bad_grammar_is_a_400_naming_the_tool(server: Server) -> None:
    bad = TOOL | {"format": {"type": "grammar", "syntax": "lark", "definition": "start: /unclosed"}}
    got, answer = server.raw("POST", "/v1/responses", json.dumps({"input": "hi", "tools": [bad]}).encode())
    assert got == 400 and "tool 'edit': its Lark grammar" in answer["error"]["message"], answer
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [custom("edit", ENTRIES)]}
    got, answer = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert got == 400 and "custom tools are not supported here" in answer["error"]["message"], answer
