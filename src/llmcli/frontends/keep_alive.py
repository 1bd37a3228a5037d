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
from typing import TYPE_CHECKING, Any

from llmcli.config.declare import declarations, flag_of
from llmcli.config.paths import state_dir
from llmcli.config.settings import LoadSettings, RemoteSettings
from llmcli.frontends import terminal

if TYPE_CHECKING:
    from llmcli.server.runtime import ServerRecord


def keep_alive_after(model: str | None, load: LoadSettings, seconds: float, remote: RemoteSettings) -> None:
    """Start the background server, unless the call went to a server (named, or one running with
    this model and these settings, which the call itself kept busy). Keep-alive is a convenience:
    where its folders cannot be written, that is said once and the call still ends well."""
    if remote.url:
        return  # a server named: nothing was loaded here
    from filelock import FileLock

    from llmcli.models.default_model import default_model_spec
    from llmcli.server.runtime import LOADING, matching_server, runtime_dir

    spec, flags = model or default_model_spec(), load_flags(load)
    try:
        lock = FileLock(str(_lock_path(spec, flags)))
        writable(runtime_dir())  # a server nobody could find or stop is not worth starting
        log = log_path()
    except OSError as error:
        terminal.note(f"Cannot keep {spec} loaded in the background: {describe_os_error(error)}.")
        return
    # The lock makes check-and-start one step; the server writes its record (loading) as soon as
    # it listens, and the lock is held until then, so no later call starts a second one.
    with lock:
        running = matching_server(spec, load, note=terminal.note)
        if running is not None:
            if running.state == LOADING:
                terminal.note(f"A background server of {spec} is still loading (pid {running.pid}).")
            return
        server = _start(spec, flags, seconds, log)
        if not _announced(server):
            terminal.note(f"The background server of {spec} stopped as it started; its log: {log}")
            return
    terminal.note(
        f"Keeping {spec} loaded in the background until {seconds:g} s pass without a request "
        f"(`llmcli ps` lists it, `llmcli stop` stops it; its log: {log})."
    )


def _start(spec: str, flags: list[str], seconds: float, log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "llmcli", "serve", "-m", spec, "--host", "127.0.0.1", "--port", "0",
        "--idle-exit", f"{seconds:g}s", "--quiet", *flags,
    ]  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # not ended by the terminal's Ctrl-C or hang-up
            close_fds=True,
        )


# A server writes its record once it listens, before it loads: a second or two of imports.
_ANNOUNCE_PATIENCE_S = 60.0


def _announced(server: subprocess.Popen[bytes]) -> bool:
    """Wait until the new server's record exists (it is then listed, stoppable and found), or
    until the server has exited (a bad flag, no memory: its log says why)."""
    from llmcli.server.runtime import record_path

    deadline = time.monotonic() + _ANNOUNCE_PATIENCE_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        if record_path(server.pid).exists():
            return True
        time.sleep(0.05)
    return server.poll() is None


def _lock_path(spec: str, flags: list[str]) -> Path:
    """The lock that keeps two calls from starting a server of this model and these settings."""
    folder = state_dir() / "keep-alive"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\0".join([spec, *flags]).encode()).hexdigest()[:16]
    return folder / f"starting-{key}.lock"


def writable(folder: Path) -> None:
    """Raises the OSError a write in `folder` would meet (full, read-only, not a folder)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    probe = folder / f".probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def describe_os_error(error: OSError) -> str:
    where = f"{error.filename}: " if error.filename else ""
    return f"cannot write {where}{error.strerror or type(error).__name__}"


def report_failures(model: str | None) -> None:
    """Before a call: a background server of this model that could not start, said once; the
    call itself goes on in-process."""
    from llmcli.models.default_model import default_model_spec
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


def describe(record: ServerRecord, now: float | None = None) -> dict[str, Any]:
    """A running server as `llmcli ps` shows it: what it serves, how, its memory and idle time."""
    from llmcli.reading import peer_text
    from llmcli.server.runtime import LOADING

    now = time.time() if now is None else now
    idle = None
    with contextlib.suppress(OSError):  # the record is touched as each request ends (serve.py)
        idle = max(0.0, now - record.path.stat().st_mtime)
    defaults = dataclasses.asdict(LoadSettings())
    settings = {  # what differs from a plain load
        key: value for key, value in record.load.items() if value not in (None, defaults.get(key))
    }
    return {
        "pid": record.pid,
        "url": record.url,
        "model": record.model,
        "model_spec": record.model_spec,
        "state": record.state,
        "settings": {peer_text(str(key), 40): peer_text(str(value), 80) for key, value in settings.items()},
        "rss_bytes": resident_bytes(record.pid),
        "idle_s": round(idle, 1) if idle is not None and record.state != LOADING else None,
        "idle_exit_s": record.idle_exit_s,
        # Each model it holds (a server loads more by name, up to --models-max)
        "models": [
            {"name": peer_text(held.name), "state": held.state, "weight_bytes": held.weight_bytes}
            for held in record.models
        ],
        "models_max": record.models_max,
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


def stop_servers(records: list[ServerRecord], patience_s: float = 15.0) -> list[ServerRecord]:
    """SIGTERM each (a graceful stop: replies in flight end, the record goes), then wait for them;
    those still running after `patience_s` are returned. Each was checked to be the very server
    its record names (pid, start time, command line, port) just before; a zombie — exited, not
    yet reaped by whoever started it — counts as stopped."""
    import signal

    from llmcli.server.process_check import is_running

    for record in records:
        if is_running(record.process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + patience_s
    waiting = list(records)
    while waiting and time.monotonic() < deadline:
        waiting = [record for record in waiting if is_running(record.process)]
        if waiting:
            time.sleep(0.1)
    return waiting


def table(rows: list[dict[str, Any]]) -> str:
    """`llmcli ps` for people: one line per server."""
    from llmcli.models.memory import format_bytes
    from llmcli.reading import peer_text

    header = ("PID", "URL", "MODEL", "SETTINGS", "MEMORY", "IDLE", "STOPS WHEN IDLE FOR")
    lines = [header]
    for row in rows:
        settings = ", ".join(f"{key} {value}" for key, value in row["settings"].items())
        loading = row["state"] == "loading"
        lines.append((
            str(row["pid"]),
            peer_text(row["url"]),
            _models_cell(row),
            settings or "defaults",
            format_bytes(row["rss_bytes"]) if row["rss_bytes"] is not None else "?",
            "loading" if loading else f"{row['idle_s']:g} s" if row["idle_s"] is not None else "?",
            f"{row['idle_exit_s']:g} s" if row["idle_exit_s"] else "never (stop it with `llmcli stop`)",
        ))  # fmt: skip
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _models_cell(row: dict[str, Any]) -> str:
    """The models a server holds, most recently used first (its record's model before any)."""
    from llmcli.reading import peer_text

    if not row["models"]:
        loading = row["state"] == "loading"
        return peer_text(row["model"] or row["model_spec"] + (" (loading)" if loading else ""))
    return ", ".join(m["name"] + (" (loading)" if m["state"] == "loading" else "") for m in row["models"])


def list_servers(as_json: bool) -> None:
    """`llmcli ps`."""
    import json

    from llmcli.server.runtime import running_servers

    rows = [describe(record) for record in running_servers(note=terminal.note)]
    if as_json:
        print(json.dumps(rows))
    elif rows:
        print(table(rows))
    else:
        terminal.note("No llmcli server is running.")


def stop_command(model: str | None) -> None:
    """`llmcli stop [MODEL]`: each server stopped is a line on stdout (one still loading too)."""
    from llmcli.errors import LlmcliError
    from llmcli.reading import peer_text
    from llmcli.server.runtime import running_servers, serves_model

    chosen = [
        record
        for record in running_servers(note=terminal.note)
        if model is None or serves_model(record, model)
    ]
    if not chosen:
        if model is None:
            terminal.note("No llmcli server is running.")
            return
        raise LlmcliError(f"no llmcli server runs {model}", "`llmcli ps` lists the running ones")
    left = stop_servers(chosen)
    for record in chosen:
        if record not in left:
            name = peer_text(record.model or record.model_spec)
            print(f"stopped {name} (pid {record.pid}, {peer_text(record.url)})")
    if left:
        pids = ", ".join(str(record.pid) for record in left)
        raise LlmcliError(f"the server(s) with pid {pids} did not stop within 15 s", "kill them by hand")
