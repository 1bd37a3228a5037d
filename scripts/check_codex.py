"""Codex CLI (OpenAI's `codex`) against `llmcli serve`, end to end: a small real task, and how
far it got. Not a test (CI has no npm install of codex); the protocol's side of it is pinned by
tests/test_codex_requests.py, which replays Codex's captured requests.

  npm install --prefix /work/scratch/codex @openai/codex     # once
  python scripts/check_codex.py                              # the demo model
  python scripts/check_codex.py --codex PATH -m MODEL --task "create hello.txt containing hi"

It starts `llmcli serve --drop-hosted-tools` on a free port, writes a CODEX_HOME of its own (a
model provider with `wire_api = "responses"`, nothing that phones home), runs `codex exec
--json` in a temporary folder, and prints: the first request accepted, a tool call made, the
tool's output sent back and answered, and the task's outcome (the file there?). A 135M model
may not solve the task; the lines say whether the protocol was the reason. The default
instructions are short (Codex's own are ~6,600 tokens; with its tools the prompt passes the
demo's 8,192-token context) and show the model one call, written as llmcli's generic tool
format writes it. With --compact-at, Codex is told the context and compacts past that many tokens:
for a custom provider, with a summary turn on /v1/responses (the access log shows it: a prompt
past the limit, then one that is short again).
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

SCRATCH_CODEX = Path("/work/scratch/codex/node_modules/.bin/codex")
TASK = "Run this command with the exec_command tool: printf hi > hello.txt"
# Where the model answers the task in text: the same task once more, the call spelled out for it
# (a 135M model copies better than it plans), so that the round trip is exercised all the same.
SPELLED_OUT = (
    'Reply with exactly this and nothing else:\n<tool_call>\n{"name": "exec_command", "arguments": '
    '{"cmd": "printf hi > hello.txt"}}\n</tool_call>'
)
INSTRUCTIONS = """You are a coding agent in a terminal. You act by calling the exec_command tool,
which runs a shell command in the workspace.
Example. User: create notes.txt containing ok
Assistant: <tool_call>
{"name": "exec_command", "arguments": {"cmd": "printf ok > notes.txt"}}
</tool_call>
After the command ran, say "Done." and stop.
"""
CONFIG = """model = "{model}"
model_provider = "llmcli"
check_for_update_on_startup = false
{compaction}{instructions}
[model_providers.llmcli]
name = "llmcli"
base_url = "{url}/v1"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

[features]
goals = false
apps = false
plugins = false
image_generation = false
{lean}"""
# Without --full: fewer tools and no skills list, so that a small model's prompt is mostly the task.
LEAN = """view_image = false
skill_search = false

[agents]
enabled = false
"""
SPELLED_OUT_TRIES = 8  # the demo samples (its generation_config's temperature): it may copy on a later try


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--codex", type=Path, default=None, help="the codex binary (default: the scratch install, then PATH)"
    )
    parser.add_argument("-m", "--model", default=None, help="the model to serve (default: the demo)")
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--expect", default="hello.txt", help="the file the task makes")
    parser.add_argument(
        "--codex-instructions", action="store_true", help="Codex's own long instructions, not the short ones"
    )
    parser.add_argument(
        "--full", action="store_true", help="every tool Codex offers by default (its sub-agents too)"
    )
    parser.add_argument("--timeout", type=float, default=1500, help="seconds for the whole codex run")
    parser.add_argument(
        "--compact-at",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tell Codex the context (8192, the demo's) and to compact past TOKENS: its summary turn on "
        "/v1/responses, what it does for a custom provider (never /v1/responses/compact)",
    )
    parser.add_argument(
        "--context", type=int, default=8192, help="the served model's context (with --compact-at)"
    )
    args = parser.parse_args()

    codex = args.codex or (SCRATCH_CODEX if SCRATCH_CODEX.exists() else shutil.which("codex"))
    if codex is None or not Path(codex).exists():
        print("no codex here: npm install --prefix /work/scratch/codex @openai/codex, or pass --codex PATH")
        return 2
    version = subprocess.run([str(codex), "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="llmcli-codex-") as scratch:
        home, work = Path(scratch) / "codex-home", Path(scratch) / "work"
        home.mkdir()
        work.mkdir()
        server = Server(args.model, Path(scratch) / "runtime")
        try:
            instructions = ""
            if not args.codex_instructions:
                (home / "instructions.md").write_text(INSTRUCTIONS)
                instructions = f'model_instructions_file = "{home / "instructions.md"}"\n'
            lean = "" if args.full else LEAN
            compaction = ""
            if args.compact_at is not None:
                window = f"model_context_window = {args.context}\n"
                compaction = f"{window}model_auto_compact_token_limit = {args.compact_at}\n"
            config = CONFIG.format(
                model=server.model,
                url=server.url,
                instructions=instructions,
                lean=lean,
                compaction=compaction,
            )
            (home / "config.toml").write_text(config)
            print(f"codex: {codex} ({version})")
            print(
                f"server: llmcli serve {'-m ' + args.model if args.model else '(the demo)'} at {server.url}"
            )
            tasks = [args.task] if args.task != TASK else [TASK] + [SPELLED_OUT] * SPELLED_OUT_TRIES
            for number, task in enumerate(tasks, 1):
                print(f"\nrun {number}: {task!r} in {work}")
                seen = len(server.log)
                events, stderr = run_codex(Path(codex), home, work, task, args.timeout)
                made_a_call = report(events, stderr, server.log[seen:], work / args.expect)
                if made_a_call:
                    break
        finally:
            server.stop()
        print("\nserver log:")
        for line in server.log:
            print(f"  {line}")
    return 0


class Server:
    """`llmcli serve` on a free port; its stderr (the access log) kept."""

    def __init__(self, model: str | None, runtime: Path) -> None:
        command = [sys.executable, "-m", "llmcli", "serve", "--port", "0", "--drop-hosted-tools"]
        command += ["-m", model] if model else []
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line.rstrip())
            if line.startswith("Serving "):  # "Serving NAME at URL/v1 (Ctrl-C stops)."
                self.model = line.split()[1]
                self.url = line.split(" at ", 1)[1].split("/v1", 1)[0]
                break
        else:
            raise SystemExit("the server did not start:\n" + "\n".join(self.log))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line.rstrip())

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.reader.join(timeout=10)


def run_codex(codex: Path, home: Path, work: Path, task: str, timeout: float) -> tuple[list[dict], str]:
    command = [str(codex), "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", task]
    env = {**os.environ, "CODEX_HOME": str(home)}
    try:
        done = subprocess.run(
            command,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        out = (
            (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        )
        err = f"codex ran past {timeout:.0f} s and was stopped"
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events, err


def report(events: list[dict], stderr: str, log: list[str], expected: Path) -> bool:
    """How far one codex run got, printed; whether the model made a tool call."""
    posts = [line for line in log if "POST /v1/responses" in line]
    accepted = [line for line in posts if " 200 " in line]
    refused = [line for line in posts if " 200 " not in line]
    items = [event["item"] for event in events if event.get("type") == "item.completed"]
    calls = [
        item for item in items if item.get("type") in ("command_execution", "mcp_tool_call", "file_change")
    ]
    messages = [item.get("text", "") for item in items if item.get("type") == "agent_message"]
    errors = [item.get("message", "") for item in items if item.get("type") == "error"]
    errors += [
        event.get("message") or json.dumps(event.get("error"))
        for event in events
        if event.get("type") in ("error", "turn.failed")
    ]
    counts = f"{len(accepted)} answered, {len(refused)} refused"
    print(f"1. first request accepted: {'yes' if accepted else 'no'} ({counts})")
    for line in refused:
        print(f"   refused: {line}")
    if calls:
        first = calls[0]
        detail = first.get("command") or first.get("tool") or first.get("type")
        print(f"2. a tool call made: yes ({len(calls)}; first: {detail}, exit code {first.get('exit_code')})")
    else:
        print("2. a tool call made: no (the model answered in text)")
    answered_after = bool(calls) and len(accepted) >= 2
    print(f"3. the tool output sent back and answered: {'yes' if answered_after else 'no'}")
    if expected.exists():
        print(f"4. outcome: {expected.name} is there, holding {expected.read_text()[:80]!r}")
    else:
        print(f"4. outcome: no {expected.name}")
    for message in messages[-1:]:
        print(f"   the model's last word: {message[:300]!r}")
    for error in errors:
        print(f"   codex said: {error}")
    if stderr.strip():
        print("   codex stderr (last lines): " + " | ".join(stderr.strip().splitlines()[-3:]))
    return bool(calls)


if __name__ == "__main__":
    sys.exit(main())
