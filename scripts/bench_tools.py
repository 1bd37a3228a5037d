"""Tool calls on the demo model (SmolLM2-135M-Instruct, whose template knows no tools: the
generic format): how many calls are valid, and what the call grammar costs per token.

  python scripts/bench_tools.py            # the demo model on this CPU
  python scripts/bench_tools.py --runs 5   # timing runs per prompt (median and spread)

20 prompts that call for one of 5 tools, greedy, each run three ways on the same prompt (the
tools described in the system message):
  required  the reply is a call, from the first token (one call: parallel_tool_calls off);
  auto      free text until the model writes <tool_call>, then the call under the grammar;
  plain     the same prompt as auto, generated without the grammar (the baseline).
Reported: valid calls (parse, name a given tool, arguments validate), calls to the tool the
prompt asks for, plain answers, malformed calls (an opener left in the text, or a call that does
not validate), and decode ms/token with the time spent in the grammar itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_structured import TimedConstraint
from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.conversation import prompt_ids
from llmcli.engine.loop import Engine
from llmcli.engine.reply import ReplyStream
from llmcli.engine.tools import ToolRequest, parse_tools
from llmcli.engine.tools.turn import tool_turn


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TEXT = {"type": "string", "maxLength": 40}
TOOLS = [
    function("get_weather", "The current weather in a city.", {"city": TEXT}, ["city"]),
    function(
        "convert_units",
        "Convert a quantity from one unit to another.",
        {"value": {"type": "number"}, "from_unit": TEXT, "to_unit": TEXT},
        ["value", "from_unit", "to_unit"],
    ),
    function("get_time", "The current local time in a city.", {"city": TEXT}, ["city"]),
    function(
        "search_web", "Search the web for a query.", {"query": {"type": "string", "maxLength": 80}}, ["query"]
    ),
    function("calculate", "Evaluate an arithmetic expression.", {"expression": TEXT}, ["expression"]),
]
PROMPTS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in London today?", "get_weather"),
    ("How hot is it in Cairo at the moment?", "get_weather"),
    ("Tell me the current weather in Tokyo.", "get_weather"),
    ("Do I need an umbrella in Seattle today?", "get_weather"),
    ("Convert 5 miles to kilometers.", "convert_units"),
    ("How many pounds is 70 kilograms?", "convert_units"),
    ("What is 100 degrees Fahrenheit in Celsius?", "convert_units"),
    ("Convert 3 liters to gallons.", "convert_units"),
    ("How many inches are in 2 meters?", "convert_units"),
    ("What time is it in New York?", "get_time"),
    ("What's the local time in Sydney?", "get_time"),
    ("Tell me the time in Berlin right now.", "get_time"),
    ("Search the web for the latest Python release.", "search_web"),
    ("Find news about the Mars rover.", "search_web"),
    ("Look up who won the 2022 World Cup.", "search_web"),
    ("What is 17 times 23?", "calculate"),
    ("Calculate 144 divided by 12.", "calculate"),
    ("What is the square of 31?", "calculate"),
    ("Add 1234 and 5678.", "calculate"),
]


def reply(engine: Engine, loaded, messages: list[dict], choice: str | None, tokens: int):
    """One greedy reply: (answer, calls, result, seconds in the grammar)."""
    tools = parse_tools(TOOLS, "tools")
    # One call per reply: a small model held to "calls only" otherwise chains calls to the limit.
    # No choice: the same prompt as auto (the tools described), generated without the grammar.
    request = ToolRequest(tools, choice or "auto", parallel=False)
    turn = tool_turn(loaded.tokenizer, messages, request, loaded.vocab_size, loaded.eos_token_ids)
    ids = prompt_ids(loaded.tokenizer, turn.messages, options=turn.options)
    constraint = None
    if turn.output is not None and choice is not None:
        constraint = TimedConstraint(turn.output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    TimedConstraint.seconds = 0.0
    engine.reset()
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    generation = engine.generate(ids, params, loaded.tokenizer, constraint, keep_special=True)
    stream = ReplyStream(loaded.tokenizer, ids, turn.reader() if choice is not None else None)
    list(stream.split(generation))
    answer, _, _, calls = stream.summary(generation.result)
    return answer, calls, generation.result, TimedConstraint.seconds


def valid(call) -> bool:
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    try:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="timing runs per prompt and mode")
    parser.add_argument("-n", "--tokens", type=int, default=96)
    args = parser.parse_args()
    from llmcli.models.load import load_model
    from llmcli.models.resolve import demo_gguf_path, resolve_model

    loaded = load_model(resolve_model(str(demo_gguf_path())), LoadSettings(device="cpu"))
    engine = Engine.for_loaded(loaded)
    engine.warm_up()
    print(
        f"{loaded.name} · {loaded.device} · {loaded.dtype_name} · quant {loaded.quant} · engine {engine.name}"
    )
    warm = [{"role": "user", "content": PROMPTS[0][0]}]
    reply(engine, loaded, warm, "auto", 8)  # the tokenizer's grammar view, made once
    counts = {mode: {"valid": 0, "right": 0, "plain": 0, "malformed": 0} for mode in ("required", "auto")}
    step_ms: dict[str, list[float]] = {"required": [], "auto": [], "plain": []}
    lengths: dict[str, list[int]] = {"required": [], "auto": [], "plain": []}
    grammar_us: dict[str, list[float]] = {"required": [], "auto": []}
    for text, wanted in PROMPTS:
        messages = [{"role": "user", "content": text}]
        for run in range(args.runs):  # interleaved: the machine's load falls on every mode alike
            for mode, choice in (("required", "required"), ("auto", "auto"), ("plain", None)):
                answer, calls, result, seconds = reply(engine, loaded, messages, choice, args.tokens)
                if result.stats.decode_tok_s:
                    step_ms[mode].append(1000 / result.stats.decode_tok_s)
                lengths[mode].append(result.stats.completion_tokens)
                if mode == "plain":
                    continue
                if result.stats.completion_tokens:
                    grammar_us[mode].append(1e6 * seconds / result.stats.completion_tokens)
                if run:
                    continue
                tally = counts[mode]
                good = [call for call in calls if valid(call)]
                tally["valid"] += bool(calls) and len(good) == len(calls)
                tally["right"] += any(call.name == wanted for call in good)
                tally["plain"] += not calls and "<tool_call>" not in answer
                tally["malformed"] += len(good) != len(calls) or "<tool_call>" in answer
    plain = statistics.median(step_ms["plain"])
    print()
    print(
        f"20 prompts, 5 tools, greedy, up to {args.tokens} tokens; "
        f"timings: median (min–max) of {args.runs} runs each"
    )
    print()
    print(
        "| tool_choice | valid calls | the tool asked for | plain answers | malformed "
        "| tokens per reply | decode ms/token | in the grammar, per token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in ("required", "auto", "plain"):
        times = step_ms[mode]
        median, low, high = statistics.median(times), min(times), max(times)
        spread = f"{statistics.mean(lengths[mode]):.0f} | {median:.2f} ({low:.2f}–{high:.2f})"
        if mode == "plain":
            print(f"| none (no grammar) | – | – | – | – | {spread} | – |")
            continue
        tally, inside = counts[mode], statistics.median(grammar_us[mode])
        print(
            f"| {mode} | {tally['valid']}/20 | {tally['right']}/20 | {tally['plain']}/20 "
            f"| {tally['malformed']} "
            f"| {spread} | {inside:.0f} µs = {100 * inside / 1000 / plain:.1f} % of a plain step |"
        )


if __name__ == "__main__":
    main()
