"""Tool calls: recognised from the template, generated under a grammar built from the tools'
schemas (so every call parses and validates), read back out as the reply streams, and sent back
to the template as the family writes them."""

from __future__ import annotations

import json

import pytest

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.conversation import prompt_ids
from llmcli.engine.loop import Engine
from llmcli.engine.reasoning import REASONING
from llmcli.engine.reply import TOOL_CALL, ReplyStream
from llmcli.engine.structured.constraint import Constraint
from llmcli.engine.tools import ToolRequest
from llmcli.engine.tools.formats import GENERIC, HARMONY_TOOLS, HERMES, LLAMA3, MISTRAL, tool_format_of
from llmcli.engine.tools.offered import parse_choice, parse_tools
from llmcli.engine.tools.reader import CallArguments, CallStart, read_calls
from llmcli.engine.tools.turn import tool_turn
from llmcli.errors import LlmcliError, UsageError

from tiny_models import CHATML_TEMPLATE, build_tiny_model
from tool_templates import (
    ADDED,
    HARMONY_TEMPLATE,
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    SPECIAL,
    TOOLS,
)

jsonschema = pytest.importorskip("jsonschema")

FAMILIES = {
    "hermes": (HERMES_TEMPLATE, HERMES),
    "llama3": (LLAMA3_TEMPLATE, LLAMA3),
    "mistral": (MISTRAL_TEMPLATE, MISTRAL),
    "generic": (CHATML_TEMPLATE, GENERIC),
    "harmony": (HARMONY_TEMPLATE, HARMONY_TOOLS),
}
# An answer without a call, and what may come before a call, as each family writes them: harmony
# answers in its final channel, and a call is a message of its own.
PLAIN = {family: "It is sunny in Paris today." for family in FAMILIES} | {
    "harmony": "<|channel|>final<|message|>It is sunny in Paris today."
}
LEAD = {family: "" if fmt.at_reply_start else "Let me check. " for family, (_, fmt) in FAMILIES.items()}
LEAD["harmony"] = ""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory):
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    folder = build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-tools", "llama", added=ADDED, special=SPECIAL
    )
    loaded = load_model(resolve_model(str(folder)), LoadSettings(device="cpu", dtype="fp32", threads=1))
    return loaded, Engine.for_loaded(loaded)


def ask_with_tools(
    tool_model, family: str, request: ToolRequest, seed: int, messages=ASK, max_new: int = 120
):
    """One reply as the server makes it: events, the answer, the calls, the result."""
    loaded, engine = tool_model
    tokenizer = loaded.tokenizer
    tokenizer.chat_template = FAMILIES[family][0]
    turn = tool_turn(tokenizer, messages, request, loaded.vocab_size, loaded.eos_token_ids)
    ids = prompt_ids(tokenizer, turn.messages, options=turn.options)
    constraint = None
    if turn.output is not None:
        constraint = Constraint(turn.output, tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=max_new)
    engine.reset()
    # harmony: a random model that opens the analysis channel would think to the length limit
    budget = 6 if family == "harmony" else None
    generation = engine.generate(ids, params, tokenizer, constraint, budget, keep_special=True)
    stream = ReplyStream(tokenizer, ids, turn.reader())
    events = list(stream.split(generation))
    answer, _, _, calls = stream.summary(generation.result)
    return events, answer, calls, generation.result


def assert_valid(calls, offered) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in offered}
    for call in calls:
        assert call.name in schemas
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_recognised_from_its_template(tool_model, family: str) -> None:
    tokenizer = tool_model[0].tokenizer
    tokenizer.chat_template = FAMILIES[family][0]
    assert tool_format_of(tokenizer) == FAMILIES[family][1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_required_and_named_calls_always_parse_and_validate(tool_model, family: str, seed: int) -> None:
    tools = parse_tools(TOOLS, "tools")
    # Several calls in one reply: each complete one valid, wherever the length limit cut.
    _, _, calls, _ = ask_with_tools(tool_model, family, ToolRequest(tools, "required"), seed)
    assert calls
    assert_valid(calls, TOOLS)
    for choice in ("required", "convert_units"):
        request = ToolRequest(tools, choice, parallel=False)
        events, answer, calls, result = ask_with_tools(tool_model, family, request, seed)
        assert result.finish_reason == "stop", result.text  # the grammar ended the reply, not the limit
        assert len(calls) == 1 and answer == ""
        assert_valid(calls, TOOLS)
        if choice != "required":
            assert {call.name for call in calls} == {choice}
        # The streamed parts reassemble to the calls.
        starts = [piece for channel, piece in events if isinstance(piece, CallStart)]
        assert [(s.id, s.name) for s in starts] == [(c.id, c.name) for c in calls]
        for index, call in enumerate(calls):
            parts = [p.text for _, p in events if isinstance(p, CallArguments) and p.index == index]
            assert "".join(parts) == call.arguments
        # Nothing but the call (and harmony's thinking before it, in its own channel).
        assert all(channel in (TOOL_CALL, REASONING) for channel, _ in events)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_never_yields_a_malformed_call_and_none_never_a_call(tool_model, family: str) -> None:
    tools = parse_tools(TOOLS, "tools")
    fmt = FAMILIES[family][1]
    for seed in range(4):
        room = 120 if family == "harmony" else 60  # its thinking and headers take tokens too
        request = ToolRequest(tools, "auto")
        _, answer, calls, result = ask_with_tools(tool_model, family, request, seed, max_new=room)
        assert_valid(calls, TOOLS)
        if result.finish_reason == "stop":  # a call the length limit cut is given back as text, by design
            assert fmt.opener not in answer or fmt.at_reply_start  # a call's opener is never left as text
        _, answer, calls, _ = ask_with_tools(tool_model, family, ToolRequest(tools, "none"), seed, max_new=20)
        assert calls == []


def none_accepts(tokenizer, loaded_sizes, text: str) -> bool:
    """Whether the grammar of tool_choice "none" lets a reply write `text`."""
    vocab_size, eos = loaded_sizes
    turn = tool_turn(tokenizer, ASK, ToolRequest(parse_tools(TOOLS, "tools"), "none"), vocab_size, eos)
    assert turn.reader() is None  # no call is read out of such a reply
    constraint = Constraint(turn.output, tokenizer, vocab_size, eos)
    try:
        for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
            constraint.advance(token_id)
    except LlmcliError:
        return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_none_keeps_the_model_from_starting_a_call(tool_model, tiny_llama, family: str) -> None:
    from transformers import AutoTokenizer

    loaded = tool_model[0]
    tokenizers = [loaded.tokenizer]
    if family == "generic":  # also a tokenizer where the opener is plain text, not an added token
        tokenizers.append(AutoTokenizer.from_pretrained(tiny_llama))
    fmt = FAMILIES[family][1]
    call = LEAD[family] + fmt.write([("get_weather", {"city": "Paris"})])
    for tokenizer in tokenizers:
        tokenizer.chat_template = FAMILIES[family][0]
        sizes = (loaded.vocab_size, loaded.eos_token_ids)
        assert none_accepts(tokenizer, sizes, PLAIN[family])
        assert not none_accepts(tokenizer, sizes, call), call


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_result_turn_round_trips_through_the_template(tool_model, family: str) -> None:
    tools = parse_tools(TOOLS, "tools")
    _, _, calls, _ = ask_with_tools(tool_model, family, ToolRequest(tools, "get_weather"), 0)
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call.openai() for call in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees, clear"},
    ]
    loaded = tool_model[0]
    tokenizer = loaded.tokenizer
    turn = tool_turn(tokenizer, history, ToolRequest(tools, "auto"), loaded.vocab_size, loaded.eos_token_ids)
    text = tokenizer.decode(prompt_ids(tokenizer, turn.messages, options=turn.options))
    assert "18 degrees, clear" in text
    # The call is written back as the family writes it: the model reads its own call again.
    written = FAMILIES[family][1].write([(calls[0].name, json.loads(calls[0].arguments))])
    body = written.removeprefix(FAMILIES[family][1].opener).removesuffix(FAMILIES[family][1].closer)
    assert body in text
    _, _, later, _ = ask_with_tools(tool_model, family, ToolRequest(tools, "auto"), 1, history, 30)
    assert_valid(later, TOOLS)


def test_a_tool_result_must_answer_an_earlier_call(tool_model) -> None:
    tokenizer = tool_model[0].tokenizer
    tokenizer.chat_template = HERMES_TEMPLATE
    stray = [*ASK, {"role": "tool", "tool_call_id": "call_nowhere", "content": "18"}]
    with pytest.raises(UsageError, match="call_nowhere"):
        tool_turn(tokenizer, stray, None, 0, frozenset())


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("not a list", "a JSON array"),
        ([{"type": "function", "function": {"name": "has space"}}], "1-64 letters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "'f'"),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
                }
            ],
            "'f'",
        ),
        ([{"type": "retrieval"}], "tool 0"),
        ([TOOLS[0], TOOLS[0]], "offered twice"),
    ],
)
def test_bad_tools_are_one_line_naming_the_tool(tools, message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        parse_tools(tools, "tools")
    assert "\n" not in caught.value.one_line()


def test_tool_choice_must_name_an_offered_tool() -> None:
    tools = parse_tools(TOOLS, "tools")
    assert (
        parse_choice({"type": "function", "function": {"name": "get_weather"}}, tools, "t") == "get_weather"
    )
    with pytest.raises(UsageError, match="'nowhere', which is not among the tools"):
        parse_choice({"type": "function", "function": {"name": "nowhere"}}, tools, "tool_choice")
    with pytest.raises(UsageError, match="tool_choice"):
        parse_choice("sometimes", tools, "tool_choice")


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3, GENERIC, HARMONY_TOOLS])
def test_calls_are_read_back_wherever_the_pieces_break(fmt) -> None:
    calls = [
        ("get_weather", {"city": 'Pa"ris}{', "unit": "celsius"}),
        ("convert_units", {"value": 3, "to": "km"}),
    ]
    calls = calls if fmt.between else calls[:1]
    lead = "" if fmt.at_reply_start else "Let me check. "
    text = lead + fmt.write(calls)
    for cut in range(1, len(text)):
        answer, read = read_calls(fmt, [text[:cut], text[cut:]])
        assert answer == lead and [(c.name, json.loads(c.arguments)) for c in read] == calls, cut
    # A call cut short (the length limit) is text, never a call.
    answer, read = read_calls(fmt, [text[:-4]])
    assert read[: len(calls) - 1] == read and len(read) < len(calls)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_lets_text_run_free_and_holds_a_started_call_to_the_grammar(tool_model, family: str) -> None:
    """Token by token through the constraint: free text is accepted and may end the reply; once
    the family's opener is written, only a valid call can follow."""
    loaded = tool_model[0]
    tokenizer = loaded.tokenizer
    tokenizer.chat_template, fmt = FAMILIES[family]
    request = ToolRequest(parse_tools(TOOLS, "tools"), "auto")
    turn = tool_turn(tokenizer, ASK, request, loaded.vocab_size, loaded.eos_token_ids)

    def accepts(text: str) -> tuple[bool, bool]:
        constraint = Constraint(turn.output, tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            for token_id in ids:
                constraint.advance(token_id)
        except LlmcliError:  # the grammar refused a token
            return False, False
        return True, constraint.complete

    lead = LEAD[family]
    assert accepts(PLAIN[family]) == (True, True)
    good = fmt.write([("get_weather", {"city": "Paris", "unit": "celsius"})])
    assert accepts(lead + good) == (True, True)
    bad = fmt.write([("get_weather", {"city": "Paris", "unit": "kelvin"})])
    assert accepts(lead + bad)[0] is False
    unknown = fmt.write([("launch_rockets", {})])
    assert accepts(lead + unknown)[0] is False
