"""--keep-alive: after a call that loaded its model in-process, a `llmcli serve` of that model
and those settings stays in the background until it has gone the given time without a request.
Later calls find it as they find any running server (server/runtime.py), and skip the load.

The background server binds loopback only, logs to a file under the state dir, and stops by
itself (`serve --idle-exit`); `llmcli ps` lists such servers, `llmcli stop` stops them. Nothing
here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmcli.config.declare import declarations, flag_of
from llmcli.config.paths import state_dir
from llmcli.config.settings import LoadSettings, RemoteSettings
from llmcli.frontends import terminal


def keep_alive_after(model: str | None, load: LoadSettings, seconds: float, remote: RemoteSettings) -> None:
    """Start the background server, unless the call went to a server (named, or one running with
    this model and these settings, which the call itself kept busy)."""
    if remote.url:
        return  # a server named: nothing was loaded here
    from filelock import FileLock

    from llmcli.models.resolve import default_model_spec
    from llmcli.server.runtime import matching_server

    spec = model or default_model_spec()
    flags = load_flags(load)
    starting = _starting_marker(spec, flags)
    # A server writes its record only once loaded: until then the marker says one is on its way,
    # so that calls made meanwhile do not start one each. The lock makes check-and-start one step.
    with FileLock(f"{starting}.lock"):
        if matching_server(spec, load) is not None:
            return
        pid = _pid_in(starting)
        if pid is not None:
            terminal.note(f"A background server of {spec} is still loading (pid {pid}).")
            return
        _start(spec, flags, seconds, starting)
    terminal.note(
        f"Keeping {spec} loaded in the background until {seconds:g} s pass without a request "
        f"(`llmcli ps` lists it, `llmcli stop` stops it; its log: {log_path()})."
    )


def _start(spec: str, flags: list[str], seconds: float, starting: Path) -> None:
    command = [
        sys.executable, "-m", "llmcli", "serve", "-m", spec, "--host", "127.0.0.1", "--port", "0",
        "--idle-exit", f"{seconds:g}s", "--quiet", *flags,
    ]  # fmt: skip
    with open(log_path(), "ab") as out:
        server = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # not ended by the terminal's Ctrl-C or hang-up
            close_fds=True,
        )
    starting.write_text(str(server.pid))


def _starting_marker(spec: str, flags: list[str]) -> Path:
    """Where a background server of this model and these settings notes its pid as it starts."""
    folder = state_dir() / "keep-alive"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\0".join([spec, *flags]).encode()).hexdigest()[:16]
    return folder / f"starting-{key}.pid"


def _pid_in(marker: Path) -> int | None:
    """The pid a marker names, while that process lives (a server that loaded, or gave up, and
    exited leaves a stale marker: ignored)."""
    from llmcli.server.runtime import is_alive

    try:
        pid = int(marker.read_text())
    except (OSError, ValueError):
        return None
    return pid if is_alive(pid) else None


def report_failures(model: str | None) -> None:
    """Before a call: a background server of this model that could not start, said once; the
    call itself goes on in-process."""
    from llmcli.models.resolve import default_model_spec
    from llmcli.server.runtime import take_failures

    spec = model or default_model_spec()
    for reason in take_failures(spec):
        terminal.note(f"The background server of {spec} (--keep-alive) did not start: {reason}")


def log_path() -> Path:
    folder = state_dir() / "logs"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def load_flags(load: LoadSettings) -> list[str]:
    """The flags that give `serve` these load settings: every one that differs from its default."""
    defaults = LoadSettings()
    flags: list[str] = []
    for name, declared in declarations(LoadSettings).items():
        value = getattr(load, name)
        if value == getattr(defaults, name) or value is None:
            continue
        spellings = [flag for flag in declared.flags if flag.startswith("--")]
        if isinstance(value, bool):  # typer spells an off switch --no-…, unless declared otherwise
            on, _, off = (spellings[0] if spellings else flag_of(name, declared)).partition("/")
            flags.append(on if value else off or "--no-" + on.removeprefix("--"))
            continue
        flags += [flag_of(name, declared), str(value)]
    return flags


def describe(record: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """A running server as `llmcli ps` shows it: what it serves, how, its memory and idle time."""
    now = time.time() if now is None else now
    pid = int(record["pid"])
    from llmcli.server.runtime import record_path

    idle = None
    with contextlib.suppress(OSError):  # the record is touched as each request ends (serve.py)
        idle = max(0.0, now - record_path(pid).stat().st_mtime)
    defaults = dataclasses.asdict(LoadSettings())
    settings = {  # what differs from a plain load
        key: value
        for key, value in (record.get("load") or {}).items()
        if value not in (None, defaults.get(key))
    }
    return {
        "pid": pid,
        "url": record.get("url"),
        "model": record.get("model"),
        "model_spec": record.get("model_spec"),
        "settings": settings,
        "rss_bytes": resident_bytes(pid),
        "idle_s": round(idle, 1) if idle is not None else None,
        "idle_exit_s": record.get("idle_exit_s"),
    }


def resident_bytes(pid: int) -> int | None:
    """The process's resident memory, from /proc (Linux); None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def stop_servers(records: list[dict[str, Any]], patience_s: float = 15.0) -> list[dict[str, Any]]:
    """SIGTERM each (a graceful stop: replies in flight end, the record goes), then wait for them;
    those still running after `patience_s` are returned."""
    import signal

    from llmcli.server.runtime import is_alive

    for record in records:
        try:
            os.kill(int(record["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + patience_s
    waiting = list(records)
    while waiting and time.monotonic() < deadline:
        waiting = [record for record in waiting if is_alive(int(record["pid"]))]
        if waiting:
            time.sleep(0.1)
    return waiting


def table(rows: list[dict[str, Any]]) -> str:
    """`llmcli ps` for people: one line per server."""
    from llmcli.models.memory import format_bytes

    header = ("PID", "URL", "MODEL", "SETTINGS", "MEMORY", "IDLE", "STOPS WHEN IDLE FOR")
    lines = [header]
    for row in rows:
        settings = ", ".join(f"{key} {value}" for key, value in row["settings"].items())
        lines.append((
            str(row["pid"]),
            row["url"] or "?",
            row["model"] or "?",
            settings or "defaults",
            format_bytes(row["rss_bytes"]) if row["rss_bytes"] is not None else "?",
            f"{row['idle_s']:g} s" if row["idle_s"] is not None else "?",
            f"{row['idle_exit_s']:g} s" if row["idle_exit_s"] else "never (stop it with `llmcli stop`)",
        ))  # fmt: skip
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def list_servers(as_json: bool) -> None:
    """`llmcli ps`."""
    import json

    from llmcli.server.runtime import running_servers

    rows = [describe(record) for record in running_servers()]
    if as_json:
        print(json.dumps(rows))
    elif rows:
        print(table(rows))
    else:
        terminal.note("No llmcli server is running.")


def stop_command(model: str | None) -> None:
    """`llmcli stop [MODEL]`: each server stopped is a line on stdout."""
    from llmcli.errors import LlmcliError
    from llmcli.server.runtime import running_servers, serves_model

    chosen = [record for record in running_servers() if model is None or serves_model(record, model)]
    if not chosen:
        if model is None:
            terminal.note("No llmcli server is running.")
            return
        raise LlmcliError(f"no llmcli server runs {model}", "`llmcli ps` lists the running ones")
    left = stop_servers(chosen)
    for record in chosen:
        if record not in left:
            print(f"stopped {record.get('model')} (pid {record['pid']}, {record.get('url')})")
    if left:
        pids = ", ".join(str(record["pid"]) for record in left)
        raise LlmcliError(f"the server(s) with pid {pids} did not stop within 15 s", "kill them by hand")
