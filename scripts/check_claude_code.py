"""Claude Code on `llmcli serve`, end to end: how far a small real task gets.

Starts `llmcli serve` on a free port with a model (default: the demo), runs Claude Code
non-interactively in a temporary folder on a task ("create hello.txt containing hi"), and prints
how far it got: the first request accepted, a tool call made, a tool result sent back and
answered, and the task's outcome (the file there?). A 135M model may well not solve the task; the
steps say whether the protocol or the model stopped it. Not a test: CI has no Claude Code.

    python scripts/check_claude_code.py [--claude PATH] [-m MODEL] [--full]

Claude Code installs from the npm registry (its native binary comes as an npm package too):
    npm install --prefix ~/claude-code @anthropic-ai/claude-code
and is then ~/claude-code/node_modules/.bin/claude (or set CLAUDE_CODE_BIN).

By default Claude Code gets one tool (Write) and a one-line system prompt, so its prompt fits the
demo's 8,192-token context; --full keeps its own (~20k tokens with its 24 tools) for a model with
a context that holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SCRATCH_INSTALL = Path("/work/scratch/claude/node_modules/.bin/claude")
TASK = "create hello.txt containing hi"
SHORT_PROMPT = "You are a coding agent. Use the Write tool to create files; paths are relative to the cwd."


def main() -> int:
    options = _options()
    claude = _claude(options.claude)
    if claude is None:
        print(
            "Claude Code not found: install it with\n"
            "  npm install --prefix ~/claude-code @anthropic-ai/claude-code\n"
            "then pass --claude ~/claude-code/node_modules/.bin/claude (or set CLAUDE_CODE_BIN)",
            file=sys.stderr,
        )
        return 2
    version = subprocess.run([claude, "--version"], capture_output=True, text=True, check=False)
    print(f"claude: {claude} ({version.stdout.strip()})")
    with tempfile.TemporaryDirectory(prefix="llmcli-claude-") as scratch:
        server, url, name, log = _serve(options.model, Path(scratch))
        try:
            print(f"server: {name} at {url}")
            events = _run_claude(claude, url, name, Path(scratch), options)
        finally:
            server.terminate()
            server.wait(timeout=60)
        _report(events, log, Path(scratch) / "task")
    return 0


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = f"$CLAUDE_CODE_BIN, {SCRATCH_INSTALL}, PATH"
    parser.add_argument("--claude", help=f"the claude binary (default: {where})")
    parser.add_argument("-m", "--model", help="the model to serve (default: the demo)")
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--full", action="store_true", help="Claude Code's own system prompt and tools")
    parser.add_argument("--max-output-tokens", type=int, default=512, help="CLAUDE_CODE_MAX_OUTPUT_TOKENS")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=900, help="seconds Claude Code may run")
    return parser.parse_args()


def _claude(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("CLAUDE_CODE_BIN"), str(SCRATCH_INSTALL), shutil.which("claude")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _serve(model: str | None, scratch: Path) -> tuple[subprocess.Popen[str], str, str, list[str]]:
    """`llmcli serve` on a free port; its access log lines gathered as they come."""
    command = [sys.executable, "-m", "llmcli", "serve", "--port", "0", *(["-m", model] if model else [])]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(scratch)}  # its record apart from the user's servers
    server = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert server.stderr is not None
    line = server.stderr.readline()
    while line and "Serving" not in line:
        line = server.stderr.readline()
    if "Serving" not in line:
        raise SystemExit(f"llmcli serve did not start: {line}{server.stderr.read()}")
    name, url = line.removeprefix("Serving ").split(" at ", 1)
    url = url.split("/v1", 1)[0]
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(server.stderr.readline, "")), daemon=True).start()
    return server, url, name, log


def _run_claude(claude: str, url: str, name: str, scratch: Path, options: argparse.Namespace) -> list[dict]:
    """Claude Code's stream-json events (each message it sent and got back), run in a temporary
    folder with a HOME of its own: nothing of the user's configuration, no traffic elsewhere."""
    task, home = scratch / "task", scratch / "home"
    task.mkdir()
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "unused",  # a server started with --api-key takes it here
        "ANTHROPIC_MODEL": name,
        "ANTHROPIC_SMALL_FAST_MODEL": name,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": name,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(options.max_output_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    command = [claude, "-p", options.task, "--output-format", "stream-json", "--verbose"]
    command += ["--allowedTools", "Write", "--max-turns", str(options.max_turns)]
    if not options.full:
        command += ["--tools", "Write", "--system-prompt", SHORT_PROMPT]
    try:
        ran = subprocess.run(
            command, cwd=task, env=env, capture_output=True, text=True, timeout=options.timeout, check=False
        )
    except subprocess.TimeoutExpired as expired:
        print(f"Claude Code ran past {options.timeout} s")
        output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        return _events(output)
    if ran.returncode != 0 and ran.stderr.strip():
        print(f"Claude Code exited {ran.returncode}: {ran.stderr.strip().splitlines()[-1]}")
    return _events(ran.stdout)


def _events(output: str) -> list[dict]:
    events = []
    for line in output.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _report(events: list[dict], log: list[str], task: Path) -> None:
    requests = [line.strip() for line in log if " /v1/messages" in line]
    statuses = [line.split(" /v1/messages")[1].split()[0] for line in requests]
    blocks = [
        (event["type"], block)
        for event in events
        if event.get("type") in ("assistant", "user")
        for block in event.get("message", {}).get("content", [])
        if isinstance(block, dict)
    ]
    calls = [block for kind, block in blocks if kind == "assistant" and block.get("type") == "tool_use"]
    results = [block for kind, block in blocks if kind == "user" and block.get("type") == "tool_result"]
    first_result = next((index for index, (_, block) in enumerate(blocks) if block in results), len(blocks))
    after_result = any(kind == "assistant" for kind, _ in blocks[first_result + 1 :])
    final = next((event for event in reversed(events) if event.get("type") == "result"), {})
    print(f"requests: {len(requests)} ({', '.join(statuses) or 'none'})")
    first = requests[0] if requests else "none sent"
    print(f"first request accepted: {_yes(statuses[:1] == ['200'], first)}")
    call_note = ", ".join(f"{call.get('name')} {json.dumps(call.get('input'))[:80]}" for call in calls)
    print(f"a tool call made: {_yes(bool(calls), call_note or 'the model answered in text')}")
    result_note = (results[0].get("content") if results else "") or ""
    result_note = result_note if isinstance(result_note, str) else json.dumps(result_note)
    print(f"a tool result sent back: {_yes(bool(results), result_note[:100] or 'no call to answer')}")
    print(f"  ... and answered: {_yes(after_result, 'a reply after it' if after_result else 'not reached')}")
    hello = task / "hello.txt"
    outcome = f"hello.txt holds {hello.read_text()!r}" if hello.is_file() else "hello.txt absent"
    print(f"task outcome: {outcome}")
    if final:
        ending = str(final.get("result") or final.get("subtype") or "")
        print(f"Claude Code's result: {final.get('subtype')}, {' '.join(ending.split())[:200]}")
    refused = [line for line in requests if " 400 " in line or " 500 " in line]
    if refused:
        print(f"refused requests: {refused}")


def _yes(done: bool, detail: str) -> str:
    return f"{'yes' if done else 'no'} ({detail})"


if __name__ == "__main__":
    sys.exit(main())
