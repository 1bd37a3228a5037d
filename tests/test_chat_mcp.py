"""`chat --mcp "COMMAND ARGS…"`: a real stdio MCP server (tests/data/mcp_echo_server.py, written
with the SDK's own server) started by the chat, its tools offered and each call asked about as
--functions' are, its result read by the model; a server that fails is one line and the chat
goes on; the chat's end leaves no server running."""

from __future__ import annotations

import http.server
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import psutil
import pytest

from llmcli.engine.tools import ToolCall
from llmcli.frontends.mcp_servers import McpServers, read_commands
from test_repl import ANSI, Repl

from cli_helpers import (
    _REPORTING_TORCH,
    PATIENCE_S,
    local_http_server,
    one_error_line,
    run_cli,
    send_one_chunk,
)
from test_serve import wait_for
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL

SERVER = Path(__file__).parent / "data" / "mcp_echo_server.py"


def mcp(*flags: str) -> str:
    """The echo server's command line, as --mcp takes it."""
    return shlex.join([sys.executable, str(SERVER), *flags])


class _CallingModel(http.server.BaseHTTPRequestHandler):
    """A stand-in OpenAI-style server: a user message `NAME {args}` is answered with a call of
    NAME; a tool's result is answered with `read: RESULT`, so a test sees what the model read."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        last = body["messages"][-1]
        offered = [tool["function"]["name"] for tool in body.get("tools", [])]
        if last["role"] == "tool":
            delta, finish = {"content": f"read: {last['content']}"}, "stop"
        else:
            name, _, arguments = last["content"].partition(" ")
            function = {"name": name, "arguments": arguments or "{}"}
            delta = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": function}]}
            finish = "tool_calls"
            if name == "offered?":
                delta, finish = {"content": " ".join(offered) or "nothing"}, "stop"
        send_one_chunk(self, delta, finish)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def model_server() -> Iterator[str]:
    with local_http_server(_CallingModel) as url:
        yield url


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    """The servers' pids file and the state folder their logs go to, for the chat's environment."""
    return {"LLMCLI_TEST_MCP_PIDS": str(tmp_path / "pids"), "XDG_STATE_HOME": str(tmp_path / "state")}


def assert_no_server_left(places: dict[str, str]) -> None:
    """Every server the chat started is gone once it ended (none orphaned)."""
    pids = [int(line) for line in Path(places["LLMCLI_TEST_MCP_PIDS"]).read_text().split()]
    assert pids
    for pid in pids:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        assert not alive, f"MCP server {pid} outlived the chat"


def logs(places: dict[str, str]) -> str:
    return "".join(path.read_text() for path in (Path(places["XDG_STATE_HOME"]) / "llmcli" / "mcp").iterdir())


def chat(server: str, places: dict[str, str], *flags: str, lines: tuple[str, ...]) -> tuple[int, list, str]:
    """A scripted chat with --json: its exit code, its records and its stderr."""
    result = run_cli(
        "chat", "--server", server, "-m", "any", "--json", *flags,
        stdin="".join(f"{line}\n" for line in lines).encode(), env=places,
    )  # fmt: skip
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr
    assert_no_server_left(places)
    return result.returncode, records, stderr


def test_with_yes_a_call_goes_to_the_server_and_the_model_reads_its_result(
    model_server: str, places: dict[str, str]
) -> None:
    code, records, stderr = chat(
        model_server, places, "--mcp", mcp(), "--yes",
        lines=("offered?", 'add {"a": 2, "b": 3}', 'echo {"text": "hi"}'),
    )  # fmt: skip
    assert code == 0, stderr
    assert records[0]["reply"] == "add echo greet hang die"
    assert records[1]["tool_calls"][0] | {"id": None} == {
        "id": None,
        "name": "add",
        "arguments": {"a": 2, "b": 3},
        "result": "5",
    }
    assert records[2]["reply"] == "read: 5"  # the result went back to the model
    assert records[4]["reply"] == "read: echo: hi"
    assert "MCP: 5 tools from 1 server (add, echo, greet, hang, die)" in stderr
    # The server's own stderr is in its log, not on the chat's.
    assert "echo server" not in stderr and "echoing 'hi'" in logs(places)


def test_without_a_terminal_or_yes_no_call_is_sent(model_server: str, places: dict[str, str]) -> None:
    code, records, stderr = chat(model_server, places, "--mcp", mcp(), lines=('echo {"text": "hi"}',))
    assert code == 0, stderr
    assert records[0]["tool_calls"][0]["result"] == "The user did not allow this call to run."
    assert "echoing" not in logs(places)


def test_a_server_that_dies_mid_call_is_one_line_and_its_tools_are_withdrawn(
    model_server: str, places: dict[str, str]
) -> None:
    code, records, stderr = chat(
        model_server, places, "--mcp", mcp(), "--yes", lines=("die", "offered?", 'add {"a": 1, "b": 1}')
    )
    assert code == 1, stderr  # something failed: a scripted chat says so
    said = [line for line in stderr.splitlines() if "error" in line]
    assert (
        len(said) == 1
        and "stopped during die; its tools add, echo, greet, hang, die are withdrawn" in said[0]
    )
    assert records[0]["tool_calls"][0]["result"].startswith("error: the server of die stopped")
    assert records[2]["reply"] == "nothing"  # no tool is offered any more; the chat went on
    assert records[3]["tool_calls"][0]["result"].startswith("error: add is not one of the functions offered")


def test_a_call_that_hangs_times_out_in_one_line_and_the_server_still_answers(
    model_server: str, places: dict[str, str]
) -> None:
    code, records, stderr = chat(
        model_server, places, "--mcp", mcp(), "--yes", "--mcp-timeout", "1",
        lines=("hang", 'add {"a": 1, "b": 1}'),
    )  # fmt: skip
    assert code == 1, stderr
    assert "no answer to hang in 1 s (--mcp-timeout)" in stderr
    assert records[0]["tool_calls"][0]["result"] == "error: hang timed out after 1 s"
    assert records[2]["tool_calls"][0]["result"] == "2"


def test_servers_that_do_not_start_are_one_line_each_and_the_chat_goes_on(
    model_server: str, places: dict[str, str]
) -> None:
    code, records, stderr = chat(
        model_server, places, "--yes", "--mcp-start-timeout", "3",
        "--mcp", mcp("--exit-at-start"), "--mcp", mcp("--hang-at-start"), lines=("offered?", "add {}"),
    )  # fmt: skip
    assert code == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("llmcli: error: ")]
    assert len(errors) == 2, stderr
    assert "--exit-at-start" in errors[0]
    assert "did not start: its connection closed (the server exited)" in errors[0]
    assert "--hang-at-start" in errors[1] and "did not start in 3 s (--mcp-start-timeout)" in errors[1]
    assert records[0]["reply"] == "nothing"  # the chat went on, with no tools to offer
    assert records[1]["tool_calls"][0]["result"].startswith("error: add is not one of the functions offered")


def test_a_tool_name_offered_already_is_refused_in_one_line(
    model_server: str, places: dict[str, str], tmp_path: Path
) -> None:
    functions = tmp_path / "functions.py"
    functions.write_text('def echo(text: str) -> str:\n    """Mine."""\n    return "mine: " + text\n')
    code, records, stderr = chat(
        model_server, places, "--yes", "--functions", str(functions), "--mcp", mcp(), "--mcp", mcp(),
        lines=("offered?", 'echo {"text": "hi"}'),
    )  # fmt: skip
    assert code == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("llmcli: error: ")]
    assert len(errors) == 2, stderr
    assert errors[0].endswith("its tool echo is not offered: --functions or another --mcp has the name")
    assert "its tools add, echo, greet, hang, die are not offered" in errors[1]
    assert records[0]["reply"] == "echo add greet hang die"
    assert records[1]["tool_calls"][0]["result"] == "mine: hi"  # the file's, which came first


def test_a_chat_through_a_server_with_mcp_tools_imports_no_torch(
    model_server: str, places: dict[str, str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _REPORTING_TORCH, "chat", "--server", model_server, "-m", "any",
         "--mcp", mcp(), "--yes", "--json"],
        input='add {"a": 1, "b": 2}\n', capture_output=True, text=True, timeout=PATIENCE_S,
        env={**os.environ, **places},
    )  # fmt: skip
    assert json.loads(result.stdout.splitlines()[0])["tool_calls"][0]["result"] == "3", result.stderr
    assert result.stderr.endswith("exit 0 imported -\ntorch not imported\n"), result.stderr


def test_a_tool_choice_no_server_offers_is_refused_once_they_started(
    model_server: str, places: dict[str, str]
) -> None:
    result = run_cli(
        "chat", "--server", model_server, "-m", "any", "--mcp", mcp(), "--tool-choice", "nosuch",
        stdin=b"hello\n", env=places,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--tool-choice names 'nosuch', which is not among the tools offered" in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()
    assert_no_server_left(places)


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("no-such-mcp-server --stdio", "no program 'no-such-mcp-server' found"),
        ('python "unclosed', "No closing quotation"),
        ("  ", "--mcp needs a command line"),
    ],
)
def test_a_command_that_cannot_run_is_refused_before_anything_loads(
    places: dict[str, str], command: str, words: str
) -> None:
    result = run_cli("chat", "-m", "/nonexistent/model", "--mcp", command, stdin=b"hello\n", env=places)
    assert words in one_error_line(result, 2)


def test_without_the_sdk_mcp_says_what_to_install(places: dict[str, str], tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "mcp"  # an `mcp` that fails to import, first on the path
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("not installed")\n')
    path = os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])
    result = run_cli("chat", "--mcp", mcp(), stdin=b"hello\n", env={**places, "PYTHONPATH": path})
    assert one_error_line(result, 2).endswith("--mcp needs the MCP SDK: pip install 'llmcli[mcp]'")


def test_yes_and_tool_choice_need_tools(places: dict[str, str]) -> None:
    result = run_cli("chat", "--yes", stdin=b"", env=places)
    assert "--yes applies to the calls of --functions FILE.py or --mcp COMMAND" in one_error_line(result, 2)


# The REPL, on a real pseudo-terminal, with a tiny model that calls the tool --tool-choice names.


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-hermes-mcp"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    # The server's five tools, schemas and all, take more than the tiny model's 1,024 positions.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    return folder


def repl(model: Path, *flags: str) -> Repl:
    """The chat on a pseudo-terminal; its environment (the places) set by `repl_places`."""
    return Repl("-m", str(model), "--mcp", mcp(), "-t", "0", "-n", "60", *flags)


@pytest.fixture
def repl_places(places: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The places in this process's environment, which the pseudo-terminal's chat inherits."""
    for name, value in places.items():
        monkeypatch.setenv(name, value)
    return places


def test_the_repl_asks_before_each_call_and_the_server_runs_only_approved_ones(
    hermes_model: Path, repl_places: dict[str, str]
) -> None:
    chat_ = repl(hermes_model, "--tool-choice", "greet")
    chat_.child.sendline("Greet someone")
    chat_.child.expect(r"Run greet\? \[y\]es / \[n\]o / \[a\]lways this session:")
    assert "→ greet(who=" in ANSI.sub("", chat_.child.before)
    chat_.child.sendline("n")
    chat_.child.expect(r"not run \(declined\)")
    chat_.child.expect(">>>")
    assert "greeting" not in logs(repl_places)  # declined: the server never got the call
    chat_.child.sendline("Greet someone else")
    chat_.child.expect(r"→ greet\(who=\"(\w+)\"\)")
    who = chat_.child.match.group(1)
    chat_.child.expect(r"Run greet\?")
    chat_.child.sendline("y")
    chat_.child.expect(f"hello {who}")  # the server's answer, which the model reads next
    chat_.child.expect(">>>")
    assert f"greeting {who}" in logs(repl_places)
    assert "echo server" not in ANSI.sub("", chat_.child.before)
    assert chat_.quit() == 0
    assert_no_server_left(repl_places)


def test_ctrl_c_during_a_call_ends_the_round_and_the_chat_goes_on(
    hermes_model: Path, repl_places: dict[str, str]
) -> None:
    # A runner that started pytest with SIGINT ignored passes that on through exec; a handler of
    # this process's own is reset to the default there, so Ctrl-C reaches the chat as a person's.
    restore = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        chat_ = repl(hermes_model, "--tool-choice", "hang", "--yes", "--mcp-timeout", "600")
    finally:
        signal.signal(signal.SIGINT, restore)
    chat_.child.sendline("Wait for it")
    chat_.child.expect(r"→ hang\(\)")
    # The call announced is not yet the call made: a Ctrl-C before the server has it lands elsewhere.
    wait_for(lambda: "echo server: hanging" in logs(repl_places), "the call to reach the server")
    chat_.child.sendcontrol("c")
    said = chat_.child.expect([r"interrupted \(Ctrl-C: no more calls this turn\)", "timed out", "Traceback"])
    assert said == 0
    chat_.child.expect(">>>")
    chat_.child.sendline("/help")
    chat_.child.expect("/exit")
    chat_.child.expect(">>>")
    chat_.child.sendcontrol("d")
    chat_.child.expect(pexpect.EOF)
    assert "Traceback" not in chat_.child.before
    chat_.child.close()
    assert chat_.child.exitstatus == 0
    assert_no_server_left(repl_places)


def test_ctrl_c_while_a_server_starts_leaves_none_running(repl_places: dict[str, str]) -> None:
    restore = signal.signal(signal.SIGINT, signal.default_int_handler)  # as above: Ctrl-C reaches it
    try:
        child = pexpect.spawn(
            sys.executable,
            ["-m", "llmcli", "chat", "-m", "/nonexistent/model", "--mcp", mcp("--hang-at-start")],
            env={**os.environ, "TERM": "xterm-256color"},
            timeout=PATIENCE_S,
            encoding="utf-8",
        )
    finally:
        signal.signal(signal.SIGINT, restore)
    pids = Path(repl_places["LLMCLI_TEST_MCP_PIDS"])
    deadline = time.monotonic() + PATIENCE_S
    while not pids.exists() and time.monotonic() < deadline:  # the server is up, hanging
        child.expect([pexpect.TIMEOUT, pexpect.EOF], timeout=0.1)
    child.sendcontrol("c")
    child.expect(pexpect.EOF)
    assert "Traceback" not in child.before
    child.close()
    assert child.exitstatus == 130
    assert_no_server_left(repl_places)


def test_closing_leaves_no_thread_and_no_server(repl_places: dict[str, str]) -> None:
    """In-process: the loop's thread is joined and the process gone once the servers close."""
    before = set(threading.enumerate())
    said: list[str] = []
    with McpServers.start(read_commands([mcp()]), 30.0, 30.0, said.append) as servers:
        assert [tool.name for tool in servers.tools] == ["add", "echo", "greet", "hang", "die"]
        assert servers.call(ToolCall("call_1", "add", '{"a": 1, "b": 2}'), {"a": 1, "b": 2}) == "3"
    assert set(threading.enumerate()) == before and said == []
    assert_no_server_left(repl_places)
