"""Faults a user can cause, injected on purpose: each ends in one `llmcli: error:` line and the
right exit code (or, where nothing is wrong for the user, in a working chat), never a traceback
or an "unexpected" error, and nothing typed is lost."""

from __future__ import annotations

import http.server
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from llmcli.models.resolve import demo_gguf_path

from cli_helpers import LLMCLI, PATIENCE_S, local_http_server, one_error_line, run_cli

TIGHT = ["--device", "cpu", "-n", "4"]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["generate", "--seed", "abc", "hi"], "'--seed'"),
        (["generate", "-n", "abc", "hi"], "'--max-new-tokens'"),
        (["generate", "--no-such-option", "hi"], "--no-such-option"),
        (["frobnicate"], "'frobnicate'"),
        (["config"], "llmcli config needs a command"),
        ([], "llmcli needs a command"),
        (["bench", "--context-fill", "0"], "'--context-fill'"),
    ],
)
def test_usage_errors_are_one_line(args: list[str], names: str) -> None:
    proc = run_cli(*args)
    line = one_error_line(proc, 2)
    assert names in line and "--help" in line and proc.stdout == b""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "99999999999999999999999"], "--seed must be in 0…18446744073709551615"),
        (["--seed", "-1"], "--seed must be in 0…"),
        (["-t", "inf"], "--temperature must be ≥ 0"),
        (["-t", "1e400"], "--temperature must be ≥ 0"),
        (["--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--min-p", "inf"], "--min-p must be in [0, 1]"),
        (["--num-beams", "65"], "--num-beams must be in 1…64"),
        (["--draft-tokens", "65"], "--draft-tokens must be in 1…64"),
        (["--threads", "0"], "--threads must be ≥ 1"),
        (["--ctx", "15"], "--ctx must be at least 16"),
    ],
)
def test_numbers_beyond_their_limits_are_usage_errors(args: list[str], message: str) -> None:
    # The model does not exist: the value is refused before it would matter.
    line = one_error_line(run_cli("generate", "-m", "/nonexistent/model", *args, "hi"), 2)
    assert message in line


def test_the_largest_seed_works(tiny_llama: Path) -> None:
    proc = run_cli("generate", "-m", str(tiny_llama), *TIGHT, "--seed", str(2**64 - 1), "hi")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()


def test_a_bad_value_names_where_it_came_from(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[defaults]\ntop_p = 5\n[models."some/model"]\ntemperature = -1\n')
    from_file = one_error_line(run_cli("generate", "hi", env={"LLMCLI_CONFIG": str(config)}), 2)
    assert "top_p (config [defaults] of " in from_file and str(config) in from_file
    config.write_text('[models."some/model"]\ntemperature = -1\n')
    section = one_error_line(
        run_cli("generate", "-m", "some/model", "hi", env={"LLMCLI_CONFIG": str(config)}), 2
    )
    assert 'temperature (config [models."some/model"] of ' in section
    from_env = one_error_line(run_cli("generate", "hi", env={"LLMCLI_TEMPERATURE": "-2"}), 2)
    assert "LLMCLI_TEMPERATURE must be ≥ 0" in from_env and "--temperature" not in from_env
    folder = one_error_line(run_cli("generate", "hi", env={"LLMCLI_CONFIG": str(tmp_path)}), 2)
    assert "a folder" in folder and "does not exist" not in folder


@pytest.mark.parametrize("damage", ["truncated", "empty", "not safetensors"])
def test_damaged_weights_name_the_file(tiny_llama: Path, tmp_path: Path, damage: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for file in tiny_llama.iterdir():
        if file.is_file():
            (model / file.name).write_bytes(file.read_bytes())
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncated": data[: len(data) // 2], "empty": b"", "not safetensors": b"<html>"}[damage]
    )
    line = one_error_line(run_cli("generate", "-m", str(model), "hi"), 1)
    assert f"{weights} is damaged" in line and "download it again" in line


def test_a_closed_or_full_stdout(tiny_llama: Path) -> None:
    command = [*LLMCLI, "generate", "-m", str(tiny_llama), *TIGHT, "hi"]
    import subprocess

    no_stdout = subprocess.run(
        ["sh", "-c", '"$@" >&-', "sh", *command], stderr=subprocess.PIPE, timeout=PATIENCE_S
    )  # started with stdout closed: nobody reads it, so it ends quietly
    assert no_stdout.returncode == 0 and no_stdout.stderr == b"", no_stdout.stderr.decode()
    if Path("/dev/full").exists():
        full = subprocess.run(
            ["sh", "-c", '"$@" >/dev/full', "sh", *command], stderr=subprocess.PIPE, timeout=PATIENCE_S
        )
        line = one_error_line(full, 1)
        assert "cannot write the output" in line


def chat_with_state(model: Path, state_home: Path) -> pexpect.spawn:
    """A chat on a real pseudo-terminal, its state (the history file) under `state_home`."""
    env = {**os.environ, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"}
    env["XDG_STATE_HOME"] = str(state_home)
    return pexpect.spawn(
        sys.executable, ["-m", "llmcli", "chat", "-m", str(model), *TIGHT], env=env,
        timeout=PATIENCE_S, encoding="utf-8", dimensions=(50, 200),
    )  # fmt: skip


def test_a_history_file_that_breaks_mid_chat_is_said_once(tiny_llama: Path, tmp_path: Path) -> None:
    child = chat_with_state(tiny_llama, tmp_path / "state")
    child.expect(">>>")
    history = tmp_path / "state" / "llmcli" / "history"
    history.unlink()
    history.mkdir()  # appending to it now fails, for root too
    child.sendline("Hello there")
    child.expect("history is kept in memory only from now: cannot write")
    child.expect(r"TTFT [0-9.]+ s")  # the message was sent all the same
    child.expect(">>>")
    child.sendline("And again")
    child.expect(r"TTFT [0-9.]+ s")
    assert "history is kept" not in child.before  # said once
    child.expect(">>>")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    output = child.before
    assert child.exitstatus == 0 and "Traceback" not in output and "Press ENTER" not in output


def test_a_chat_without_a_writable_history_starts_and_works(tiny_llama: Path, tmp_path: Path) -> None:
    """The state folder under a regular file: mkdir fails for everyone, root included."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    child = chat_with_state(tiny_llama, blocker / "state")
    child.expect("History is kept in memory only: cannot write")
    child.expect(">>>")
    child.sendline("Hello there")
    child.expect(r"TTFT [0-9.]+ s")
    child.expect(">>>")
    child.sendline("/show")
    child.expect("1 exchange")
    child.expect(">>>")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in child.before


@pytest.mark.demo
@pytest.mark.skipif(demo_gguf_path() is None, reason="the demo model is not installed")
def test_concurrent_first_runs_read_once_and_all_succeed(tmp_path: Path) -> None:
    """Three first runs a quarter second apart on a fresh cache — two generations and, between
    them, an import of the same file under a name: one reads the GGUF file's small parts into
    the cache, the others wait for it; none sees a half-written folder."""
    import subprocess
    import time

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    generate = [*LLMCLI, "generate", "-t", "0", "-n", "2", "Hi"]
    runs = []
    for command in (
        generate,
        [*LLMCLI, "models", "import", str(demo_gguf_path()), "--name", "smol"],
        generate,
    ):
        runs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        time.sleep(0.25)
    outcomes = [run.communicate(timeout=PATIENCE_S) for run in runs]
    errors = [err.decode() for _, err in outcomes]
    assert [run.returncode for run in runs] == [0, 0, 0], errors
    assert sum("once into llmcli's cache" in err for err in errors) == 1, errors
    folders = [p.name for p in (tmp_path / "cache" / "llmcli" / "gguf").iterdir() if p.is_dir()]
    assert len(folders) == 1 and not folders[0].startswith("."), folders  # no staging left behind


@pytest.mark.demo
@pytest.mark.skipif(demo_gguf_path() is None, reason="the demo model is not installed")
def test_an_unwritable_cache_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc = run_cli(
        "generate", "-m", str(demo_gguf_path()), "hi", env={"XDG_CACHE_HOME": str(blocker / "cache")}
    )
    line = one_error_line(proc, 1)
    assert "cannot write llmcli's cache" in line and "XDG_CACHE_HOME" in line


def test_a_history_file_unreadable_when_the_prompt_loads_it_starts_empty(tmp_path: Path) -> None:
    """prompt-toolkit reads the history in a background thread once the prompt is up; a file
    that became a folder by then must give an empty history, not kill the loader (the line the
    user types next would never arrive)."""
    from llmcli.frontends.repl import KeptFileHistory

    path = tmp_path / "history"
    history = KeptFileHistory(str(path))
    path.mkdir()
    assert list(history.load_history_strings()) == []


class _DyingServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server that dies mid-reply: two pieces, then the connection closes
    without [DONE]."""

    def do_GET(self) -> None:
        self.send_error(404)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in ("Hel", "lo"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def dying_server() -> Iterator[str]:
    with local_http_server(_DyingServer) as url:
        yield url


def test_a_reply_cut_by_a_dying_server_is_an_error_not_a_complete_reply(dying_server: str) -> None:
    result = run_cli("generate", "--server", dying_server, "-m", "any", "--json", "hi")
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1
    assert len(lines) == 1 and "ended the reply before it was complete" in lines[0], lines
    record = json.loads(result.stdout)
    assert record["text"] == "Hello" and record["finish_reason"] == "error"
    # A chat keeps what came, marked cut, says what happened, and goes on to the next message.
    chat = run_cli("chat", "--server", dying_server, "-m", "any", stdin=b"hi\nagain\n")
    assert chat.returncode == 1 and chat.stdout.decode().count("Hello") == 2
    assert chat.stderr.decode().count("ended the reply before it was complete") == 2


@pytest.mark.parametrize(
    "args",
    [["--help"], ["generate", "--help"], ["config", "show"], ["models", "list"], ["config", "path"]],
)
def test_every_command_stops_quietly_when_its_reader_is_gone(args: list[str]) -> None:
    """stdout a pipe nobody reads (`llmcli … | head -1` after head left): exit 0, nothing on
    stderr — as generate does — for help and every command's output alike."""
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        result = subprocess.run(
            [*LLMCLI, *args], stdout=write_end, stderr=subprocess.PIPE, timeout=PATIENCE_S
        )
    finally:
        os.close(write_end)
    assert result.returncode == 0 and result.stderr == b"", result.stderr.decode()


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--server", "http://127.0.0.1:9", "-m", "any", "hi"],
        ["chat", "--server", "http://127.0.0.1:9", "-m", "any"],
        ["serve", "-m", "/nonexistent/model", "--port", "0"],
    ],
)
@pytest.mark.parametrize(
    "key", ["sekrit-4242\r\nX-Injected: 1", "sekrit-4242\n", "sekrit 4242", "sekrit-4242\x1b[2J"]
)
def test_an_api_key_that_cannot_be_a_header_is_refused_unshown(args: list[str], key: str) -> None:
    line = one_error_line(run_cli(*args, env={"LLMCLI_API_KEY": key}), 2)
    assert line.startswith("llmcli: error: LLMCLI_API_KEY holds a character an API key cannot")
    assert "sekrit" not in line
    flag = one_error_line(run_cli(*args, "--api-key", key), 2)
    assert flag.startswith("llmcli: error: --api-key holds") and "sekrit" not in flag
