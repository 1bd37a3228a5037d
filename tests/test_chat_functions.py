"""`chat --functions FILE.py`: a file's functions offered as tools, read without running it,
each call run only on approval (or --yes), its result read by the model, the chat's cache exact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmcli.config.settings import LoadSettings, SamplingSettings
from llmcli.errors import UsageError
from llmcli.frontends.chat_session import ChatSession
from llmcli.frontends.functions import Functions, read_functions
from llmcli.frontends.local import InProcessTarget
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model
from test_repl import ANSI, Repl

from cli_helpers import run_cli
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL

FUNCTIONS = '''
import json
import os
from typing import Literal

MARKER = os.environ["LLMCLI_TEST_MARKER"]
open(MARKER, "a").close()  # the file ran


def get_weather(city: Literal["Paris", "Rome"], unit: Literal["c", "f"] = "c") -> str:
    """The weather in a city now.

    Args:
        city: where
    """
    with open(MARKER, "a") as log:
        log.write(json.dumps({"city": city, "unit": unit}) + "\\n")
    return f"18 degrees {unit} in {city}"


def always_fails(loud: bool) -> str:
    """A service that is down."""
    raise RuntimeError("the weather service is down")


def _helper(anything):
    return anything
'''


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-hermes-chat"
    return build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)


@pytest.fixture
def functions_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    path, marker = tmp_path / "tools.py", tmp_path / "ran.log"
    path.write_text(FUNCTIONS)
    monkeypatch.setenv("LLMCLI_TEST_MARKER", str(marker))
    return path, marker


def test_functions_are_read_from_hints_and_docstrings_without_running_the_file(functions_file) -> None:
    path, marker = functions_file
    tools = {tool.name: tool for tool in read_functions(str(path))}
    assert set(tools) == {"get_weather", "always_fails"}  # _helper is private
    weather = tools["get_weather"]
    assert weather.description == "The weather in a city now."
    assert weather.parameters["properties"]["city"] == {"enum": ["Paris", "Rome"], "description": "where"}
    assert weather.parameters["required"] == ["city"]
    assert not marker.exists()  # described, not run


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("def f(x):\n    pass\n", "f(x) needs a type hint"),
        ("def f(x: set[int]):\n    pass\n", "has no JSON schema"),
        ("def f(*args: int):\n    pass\n", "*args"),
        ("def f(:\n", "not Python"),
        ("x = 1\n", "no public top-level functions"),
    ],
)
def test_functions_that_cannot_be_offered_are_refused_by_name(
    tmp_path: Path, source: str, words: str
) -> None:
    path = tmp_path / "f.py"
    path.write_text(source)
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        read_functions(str(path))


def scripted(model: Path, functions: Path, *flags: str, stdin: bytes) -> tuple[int, list[dict], str]:
    result = run_cli(
        "chat", "-m", str(model), "--functions", str(functions), "--tool-choice", "get_weather",
        "-t", "0", "-n", "60", *flags,
        stdin=stdin, env={"LLMCLI_TEST_MARKER": os.environ["LLMCLI_TEST_MARKER"]},
    )  # fmt: skip
    records = [json.loads(line) for line in result.stdout.decode().splitlines()] if "--json" in flags else []
    return result.returncode, records, result.stderr.decode()


def test_with_yes_each_call_runs_and_the_model_reads_its_result(hermes_model: Path, functions_file) -> None:
    path, marker = functions_file
    code, records, stderr = scripted(
        hermes_model, path, "--yes", "--json", stdin=b"Weather in Paris?\nAnd now?\n"
    )
    assert code == 0, stderr
    calls = [call for record in records for call in record["tool_calls"]]
    ran = [json.loads(line) for line in marker.read_text().splitlines()]
    assert ran and [{"unit": "c", **c["arguments"]} for c in calls if c["name"] == "get_weather"] == ran
    for call in calls:
        if call["name"] == "get_weather":
            assert (
                call["result"]
                == f"18 degrees {call['arguments'].get('unit', 'c')} in {call['arguments']['city']}"
            )
    # Each exchange ends with a reply that calls nothing; the next reply read the result first.
    assert records[-1]["tool_calls"] == [] and records[0]["tool_calls"]
    assert records[1]["prompt_tokens"] > records[0]["prompt_tokens"] + records[0]["completion_tokens"]
    assert records[1]["cached_tokens"] > 0  # the call's own tokens stayed in the cache


def test_without_a_terminal_or_yes_no_call_runs(hermes_model: Path, functions_file) -> None:
    path, marker = functions_file
    code, _, stderr = scripted(hermes_model, path, stdin=b"Weather in Paris?\n")
    assert code == 0 and "not run (no terminal to ask on: start chat with --yes" in stderr, stderr
    assert not marker.exists()  # the file itself never ran


def test_the_repl_asks_before_each_call_and_always_means_this_session(
    hermes_model: Path, functions_file
) -> None:
    path, marker = functions_file
    repl = Repl(
        "-m",
        str(hermes_model),
        "--functions",
        str(path),
        "--tool-choice",
        "get_weather",
        "-t",
        "0",
        "-n",
        "60",
    )
    repl.child.sendline("Weather in Paris?")
    repl.child.expect(r"Run get_weather\? \[y\]es / \[n\]o / \[a\]lways this session:")
    assert "→ get_weather(city=" in ANSI.sub("", repl.child.before)
    repl.child.sendline("n")
    repl.child.expect("not run \\(declined\\)")
    repl.child.expect(">>>")
    assert not marker.exists()
    repl.child.sendline("And in Rome?")
    repl.child.expect(r"Run get_weather\?")
    repl.child.sendline("a")
    repl.child.expect("18 degrees")
    repl.child.expect(">>>")
    assert len(marker.read_text().splitlines()) == 1
    repl.child.sendline("Once more?")  # approved for the session: runs without asking
    index = repl.child.expect([r"Run get_weather\?", "18 degrees"])
    assert index == 1
    repl.child.expect(">>>")
    assert repl.quit() == 0


def test_a_tool_exchange_leaves_the_cache_exact(hermes_model: Path, functions_file) -> None:
    path, _ = functions_file
    loaded = load_model(resolve_model(str(hermes_model)), LoadSettings(device="cpu", dtype="fp32", threads=1))
    target = InProcessTarget(loaded, str(hermes_model), LoadSettings())

    class Quiet:
        def __getattr__(self, name: str):
            return lambda *args: None

    functions = Functions(str(path), read_functions(str(path)), run_all=True, first_choice="get_weather")
    session = ChatSession(
        target, Quiet(), sampling=SamplingSettings(temperature=0.0, max_new_tokens=60), functions=functions
    )
    session.turn("Weather in Paris?")
    history = session.history
    roles = [m["role"] for m in history.messages]
    assert roles[:3] == ["user", "assistant", "tool"] and roles[-1] == "assistant"
    cached = history.engine.cached_ids
    assert (
        history.conversation.ids[: len(cached)] == cached and len(cached) >= len(history.conversation.ids) - 1
    )
    # /undo takes the whole exchange, calls and results included.
    assert history.undo() is not None and history.messages == []
