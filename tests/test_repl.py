"""The interactive REPL through a real pseudo-terminal, and scripted chat through real pipes."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

from cli_helpers import PATIENCE_S, run_cli

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATS_LINE = r"TTFT [0-9.]+ s · [0-9.]+ tok/s · prefilled (\d+) · reused (\d+) · context (\d+)/(\d+)"


class Repl:
    """A chat on a real pseudo-terminal, driven as a person would type."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"}
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "llmcli", "chat", *args],
            env=env,
            timeout=PATIENCE_S,
            encoding="utf-8",
            dimensions=(50, 200),
        )
        self.child.expect(">>>")

    def send(self, line: str) -> str:
        """Type a line; return what the program printed before its next prompt, without escapes."""
        self.child.sendline(line)
        self.child.expect("\r\n")  # prompt-toolkit redraws the prompt with the line before accepting it
        self.child.expect(">>>")
        return ANSI.sub("", self.child.before)

    def turn(self, line: str) -> tuple[str, re.Match[str]]:
        """Send a message; return the reply's output and its stats line."""
        self.child.sendline(line)
        self.child.expect(STATS_LINE)
        output = ANSI.sub("", self.child.before + self.child.after)
        stats = re.search(STATS_LINE, output)
        assert stats, output
        self.child.expect(">>>")
        return output, stats

    def quit(self) -> int:
        self.child.sendcontrol("d")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


def test_repl_turns_and_commands(tiny_llama: Path, tmp_path: Path) -> None:
    repl = Repl("-m", str(tiny_llama), "-t", "0", "-n", "8", "-s", "Be brief.")
    _, first = repl.turn("Hello there")
    assert int(first.group(2)) == 0  # nothing cached yet
    _, second = repl.turn("What is the capital of France?")
    assert int(second.group(2)) > int(first.group(1))  # the first exchange is reused, not prefilled

    assert "temperature = 0.7" in repl.send("/set temperature 0.7")
    assert "--temperature must be ≥ 0" in repl.send("/set temperature -1")
    assert "did you mean /undo?" in repl.send("/undp")

    assert "dropped: What is the capital of France?" in repl.send("/undo")
    assert "context" in repl.send("/show")
    _, retried = repl.turn("/retry")  # regenerates the reply to "Hello there" from the cache
    assert int(retried.group(1)) <= 2

    transcript = tmp_path / "chat.json"
    assert "saved 2 messages" in repl.send(f"/save {transcript}")
    saved = json.loads(transcript.read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["Hello there"]
    assert saved["system"] == "Be brief." and saved["settings"]["temperature"] == 0.7

    assert "conversation cleared" in repl.send("/reset")
    assert "context 0/" in repl.send("/show")
    loaded = repl.send(f"/load {transcript}")
    assert "loaded 2 messages" in loaded
    _, after_load = repl.turn("And Italy?")
    assert int(after_load.group(2)) > 0  # the loaded chat was prefilled when it was loaded

    repl.child.send("half-typed message")
    repl.child.sendcontrol("c")  # at the prompt: clears the line, sends nothing
    repl.child.expect(">>>")
    assert "4 exchanges" not in repl.send("/show")
    assert repl.quit() == 0


@pytest.mark.demo
def test_ctrl_c_mid_reply_then_another_turn(loaded_demo) -> None:
    repl = Repl("-t", "0", "-n", "400")
    repl.child.sendline("Write a long story about a dragon who learns to read.")
    repl.child.expect("learns to read.", timeout=PATIENCE_S)  # the input as typed…
    repl.child.expect(
        r"\n[^\n>]{40}", timeout=PATIENCE_S
    )  # …then 40 characters of the reply: it is streaming
    repl.child.sendcontrol("c")
    repl.child.expect(r"· interrupted")
    repl.child.expect(">>>")
    output, stats = repl.turn("What is the capital of France?")
    assert "Paris" in output
    assert int(stats.group(2)) > 20  # the interrupted exchange stayed in the cache and was reused
    show = repl.send("/show")
    assert "2 exchanges" in show
    assert repl.quit() == 0


def test_type_ahead_and_ctrl_d_during_a_reply_reach_the_next_prompt(loaded_demo) -> None:
    """Keys typed while a reply prints are not lost to the terminal's cooked mode: a command and
    then Ctrl-D, typed mid-reply, run once the reply ends. No CPR warning either, with nothing
    set in the environment (a pseudo-terminal never answers cursor position requests)."""
    env = {key: value for key, value in os.environ.items() if key != "PROMPT_TOOLKIT_NO_CPR"}
    child = pexpect.spawn(
        sys.executable, ["-m", "llmcli", "chat", "-t", "0", "-n", "120"],
        env=env | {"TERM": "xterm-256color"},
        timeout=PATIENCE_S, encoding="utf-8", dimensions=(50, 200),
    )  # fmt: skip
    child.expect(">>>")
    child.sendline("Write a short story about a lighthouse keeper.")
    child.expect("lighthouse keeper.", timeout=PATIENCE_S)
    child.expect(r"\n[^\n>]{20}", timeout=PATIENCE_S)  # the reply is streaming
    child.send("/stats\n")
    child.sendcontrol("d")
    child.expect(pexpect.EOF, timeout=PATIENCE_S)
    child.close()
    output = ANSI.sub("", child.before)
    assert child.exitstatus == 0, output
    assert "session: 1 reply" in output  # the /stats typed ahead ran, then Ctrl-D ended the chat
    assert "CPR" not in output and "WARNING" not in output


# `llmcli` in a process that stops at the start of each prompt (before prompt-toolkit has the
# terminal), says which mode the terminal is in there, and goes on when the gate file is written.
PAUSING_AT_PROMPTS = """
import runpy, sys, termios
import llmcli.frontends.repl as repl

gate, read_message = sys.argv.pop(1), repl.read_message


def paused(*args):
    cooked = termios.tcgetattr(0)[3] & termios.ICANON
    print("<<prompt:" + ("cooked" if cooked else "kept") + ">>", flush=True)
    with open(gate) as waiting:
        waiting.read(1)
    return read_message(*args)


repl.read_message = paused
sys.argv[0] = "llmcli"
runpy.run_module("llmcli", run_name="__main__")
"""


def test_a_ctrl_d_typed_as_the_stats_line_appears_ends_the_chat(tiny_llama: Path, tmp_path: Path) -> None:
    """Between a reply's stats line and the next prompt the terminal was back in cooked mode for a
    few milliseconds, and there the line discipline turns Ctrl-D into an end-of-file that
    prompt-toolkit never sees. Held at that instant, the terminal keeps what is typed."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)

    def go_on() -> None:
        with gate.open("w") as opened:
            opened.write("x")

    env = {**os.environ, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"}
    args = ["-c", PAUSING_AT_PROMPTS, str(gate), "chat", "-m", str(tiny_llama), "-t", "0", "-n", "8"]
    child = pexpect.spawn(
        sys.executable, args, env=env, timeout=PATIENCE_S, encoding="utf-8", dimensions=(50, 200)
    )
    child.expect(r"<<prompt:(\w+)>>")
    go_on()
    child.expect(">>>")
    child.sendline("Hello there")
    child.expect(STATS_LINE)
    child.expect(r"<<prompt:(\w+)>>")  # the reply has ended; the next prompt has not started
    assert child.match.group(1) == "kept"  # not cooked: what is typed now stays as typed
    child.sendcontrol("d")
    go_on()
    child.expect(pexpect.EOF)  # the prompt read the Ctrl-D and the chat ended
    child.close()
    assert child.exitstatus == 0


def test_show_and_stats_read_as_text_not_python(tiny_llama: Path, tmp_path: Path) -> None:
    saved = tmp_path / "chat.json"
    lines = f"Hi\n/show\n/stats\n/set temperature 0.3\n/save {saved}\n/set temperature 0.9\n/load {saved}\n"
    proc = run_cli("chat", "-m", str(tiny_llama), "--device", "cpu", "-n", "4", stdin=lines.encode())
    out = proc.stderr.decode()  # /show, /stats and notes; stdout holds the (random) reply alone
    assert proc.returncode == 0, out
    assert "seed none" in out and "stop none" in out and "1 exchange ·" in out and "session: 1 reply ·" in out
    for python in ("None", "()", "1 replies", "1 exchanges"):
        assert python not in out, python
    assert "brought its own settings: temperature 0.9 → 0.3" in out  # /load says what it replaced


def test_scripted_chat_writes_one_json_object_per_turn(tiny_llama: Path) -> None:
    script = "Hello there\nWhat is the capital of France?\n/undo\nAnd of Italy?\n"
    proc = run_cli("chat", "-m", str(tiny_llama), "-t", "0", "-n", "8", "--json", stdin=script.encode())
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(turns) == 3
    for turn in turns:
        for field in (
            "reply",
            "prompt_tokens",
            "prefilled_tokens",
            "cached_tokens",
            "completion_tokens",
            "ttft_s",
            "decode_tok_s",
            "finish_reason",
        ):
            assert field in turn
        assert turn["prompt_tokens"] == turn["prefilled_tokens"] + turn["cached_tokens"]
    assert turns[0]["cached_tokens"] == 0
    assert turns[1]["cached_tokens"] > turns[0]["prompt_tokens"] - 2
    # After /undo, the third turn reuses the first exchange, not the undone second one.
    assert turns[0]["prompt_tokens"] <= turns[2]["cached_tokens"] < turns[1]["prompt_tokens"]
    assert "dropped: What is the capital of France?" in proc.stderr.decode()


def test_scripted_chat_plain_output_and_exit_codes(tiny_llama: Path) -> None:
    proc = run_cli("chat", "-m", str(tiny_llama), "-t", "0", "-n", "5", stdin=b"Hi\n\n/bogus\nBye\n")
    assert proc.returncode == 1  # the unknown command is an error, and the chat went on
    assert len(proc.stdout.decode().splitlines()) >= 2
    assert b"\x1b" not in proc.stdout
    assert "unknown command /bogus" in proc.stderr.decode()


def test_scripted_chat_overflow_keeps_the_system_prompt_and_says_so(tiny_llama: Path) -> None:
    script = "".join(f"Message number {n}: tell me something about the sea.\n" for n in range(12))
    proc = run_cli(
        "chat",
        "-m",
        str(tiny_llama),
        "--ctx",
        "160",
        "-t",
        "0",
        "-n",
        "12",
        "-s",
        "Stay on topic.",
        "--json",
        stdin=script.encode(),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(turns) == 12
    assert any(turn["dropped_exchanges"] for turn in turns)
    assert all(turn["context_used"] <= 160 for turn in turns)
    assert (
        "Context full: dropped the" in proc.stderr.decode()
        and "the system prompt stays" in proc.stderr.decode()
    )


def test_scripted_chat_refuses_a_message_larger_than_the_context(tiny_llama: Path) -> None:
    script = "Hello\n" + "word " * 400 + "\nStill here?\n"
    proc = run_cli(
        "chat", "-m", str(tiny_llama), "--ctx", "160", "-t", "0", "-n", "8", "--json", stdin=script.encode()
    )
    assert proc.returncode == 1
    assert len(proc.stdout.decode().splitlines()) == 2  # the first and last messages were answered
    assert "the context holds 160" in proc.stderr.decode()


def test_multiline_input_paste_and_markdown(tiny_llama: Path, tmp_path: Path) -> None:
    repl = Repl("-m", str(tiny_llama), "-t", "0", "-n", "4", "--markdown")
    repl.child.send("first line\x1b\rsecond line")  # Esc then Enter inserts a newline
    repl.turn("")
    repl.child.send("\x1b[200~pasted one\npasted two\x1b[201~")  # a bracketed paste keeps its newline
    repl.turn("")
    repl.child.sendline('"""')
    repl.child.sendline("block one")
    repl.turn('block two"""')
    repl.child.send("/und\t")  # Tab completes the slash command
    assert "dropped: block one" in repl.send("")
    transcript = tmp_path / "multiline.json"
    repl.send(f"/save {transcript}")
    assert repl.quit() == 0
    users = [m["content"] for m in json.loads(transcript.read_text())["messages"] if m["role"] == "user"]
    assert users == ["first line\nsecond line", "pasted one\npasted two"]
