"""Where a running `llmcli serve` says it is, and how `generate`, `ps` and `stop` find one.

The server writes one JSON file per process into the runtime dir ($XDG_RUNTIME_DIR/llmcli, else
the state dir): its URL, who it is (pid, start time, command line), whether it is still loading,
the model as asked and the identity of the file or folder it loaded, and the load settings that
change what it computes.

A record is data from disk, read as such. Every field is checked for its type; one that fails is
skipped with one note and removed, never fatal. A record is believed only while a live process
matches its pid, start time and command line and listens on its port (server/process_check.py):
a stale one (its process gone, a zombie, or the pid reused by another program) is removed
quietly. A request is sent only to a loopback URL (and the caller checks that the server there
answers with the record's instance id). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmcli.atomic import write_text_atomically
from llmcli.config.paths import state_dir
from llmcli.config.settings import LoadSettings
from llmcli.reading import peer_text
from llmcli.server import process_check
from llmcli.server.process_check import ProcessIdentity

# Settings that change the numbers a model computes; threads, offload or --fast change only speed.
_MATCHING_SETTINGS = ("device", "dtype", "quant", "quant_type", "double_quant", "context_length", "engine")
# A record is a few hundred bytes; anything far larger was not written by llmcli.
_RECORD_BYTES = 64 * 1024
LOADING, READY = "loading", "ready"
_MODEL_STATES = ("loaded", "loading")
_MODELS_LISTED = 64  # models one record may list: far more than any --models-max in use

Note = Callable[[str], None]

# The record's draft model of a server started with --speculative mtp: no model spec is spelled so.
MTP_DRAFTER = "<the model's MTP head>"


@dataclass(frozen=True)
class ServerRecord:
    """A running server as its record describes it, every field checked."""

    path: Path
    url: str
    port: int
    loopback: bool  # only a loopback URL is sent requests: a file does not choose where prompts go
    process: ProcessIdentity
    instance: str  # a random id the server also gives in /health: the URL answers for this record
    state: str  # LOADING until the model is loaded, then READY
    model_spec: str
    model: str | None  # the served name, once loaded
    model_path: str
    model_identity: dict[str, Any] | None  # the file or folder loaded, when `model_spec` named one
    load: dict[str, Any]
    draft_model: str | None
    needs_key: bool
    idle_exit_s: float | None
    # The models it holds (server/fleet.py), as of the last load or unload; none while the first loads.
    models: tuple[HeldModel, ...] = ()
    models_max: int = 1  # it loads a model by name while it holds fewer than this

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(frozen=True)
class HeldModel:
    """A model a server's record says it holds, every field checked."""

    name: str  # what a request names it by
    spec: str  # what it was loaded from
    state: str  # loaded or loading
    weight_bytes: int | None
    identity: dict[str, Any] | None  # its file or folder, when `spec` names one


class BadRecord(ValueError):
    """A record llmcli would not have written: why, in a few words."""


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "llmcli" if base else state_dir() / "run"


def record_path(pid: int | None = None) -> Path:
    return runtime_dir() / f"server-{pid or os.getpid()}.json"


class RecordWriter:
    """This process's record, written as the server starts (loading) and again once it is ready.

    Keep-alive and discovery are conveniences: where the runtime folder cannot be written (full,
    read-only, not a folder), the server says so once and serves all the same."""

    def __init__(self, url: str, model_spec: str, load: LoadSettings, note: Note, **facts: Any) -> None:
        self.path = record_path()
        self.broken: str | None = None
        self._note = note
        self._record = {
            "url": url,
            **asdict(ProcessIdentity.of_this_process()),
            "instance": secrets.token_hex(16),
            "state": LOADING,
            "model_spec": model_spec,
            "model": None,
            "model_path": loaded_path(model_spec),
            "model_identity": model_identity(model_spec),
            "load": {name: asdict(load)[name] for name in _MATCHING_SETTINGS},
            # What `--speculative draft` through this server drafts with (MTP_DRAFTER: it was
            # started with --speculative mtp, the model's own head).
            "draft_model": None,
            "needs_key": False,  # started with --api-key: a client without one is refused
            "idle_exit_s": None,  # a keep-alive server stops after this long without a request
            **facts,
        }
        self._write()

    @property
    def instance(self) -> str:
        return str(self._record["instance"])

    def ready(self, model_name: str, draft_model: str | None) -> None:
        self._record.update(state=READY, model=model_name, draft_model=draft_model)
        self._write()

    def models(self, states: list[dict[str, Any]]) -> None:
        """The models the server holds now, each with its state (server/fleet.py): `llmcli ps`
        lists them, and a call finds the server that holds its model by them."""
        fields = ("name", "spec", "state", "weight_bytes")
        self._record["models"] = [
            {key: state[key] for key in fields} | {"identity": model_identity(state["spec"])}
            for state in states
        ]
        self._write()

    def touch(self) -> None:
        """Each request's end: the record's time is the server's last activity (`llmcli ps`)."""
        if self.broken is None:
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _write(self) -> None:
        """Atomic, so a reader sees all of it or nothing (and no staging file is left)."""
        if self.broken is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_text_atomically(self.path, json.dumps(self._record))
        except OSError as error:
            self.broken = error.strerror or type(error).__name__
            self._note(
                f"Cannot write this server's record in {self.path.parent} ({self.broken}): it serves, "
                "but `llmcli ps`, `llmcli stop` and other llmcli calls will not find it."
            )


def write_failure(model_spec: str, error: BaseException) -> Path | None:
    """A keep-alive server that could not start leaves why, for the next call to say once."""
    from llmcli.errors import LlmcliError

    reason = error.one_line() if isinstance(error, LlmcliError) else f"{type(error).__name__}: {error}"
    first_line = reason.splitlines()[0] if reason else ""
    path = runtime_dir() / f"failed-{os.getpid()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        failure = {
            "model_spec": model_spec,
            "model_identity": model_identity(model_spec),
            "error": first_line,
        }
        path.write_text(json.dumps(failure))
    except OSError:
        return None  # nowhere to leave it: the next call loads in-process without the reason
    return path


def take_failures(model_spec: str) -> list[str]:
    """The reasons keep-alive servers of `model_spec` could not start, each given out once."""
    folder = runtime_dir()
    reasons = []
    for path in sorted(folder.glob("failed-*.json")) if folder.is_dir() else []:
        try:
            failure = json.loads(_read_small(path))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(failure, dict):
            continue
        if not _names(model_spec, failure.get("model_identity"), (failure.get("model_spec"),)):
            continue
        reasons.append(peer_text(str(failure.get("error") or "unknown")))
        with contextlib.suppress(OSError):
            path.unlink()
    return reasons


def running_servers(note: Note | None = None, loading: bool = True) -> list[ServerRecord]:
    """The servers whose process runs, newest first (with those still loading unless
    `loading=False`). A stale record is removed; a malformed one is removed and said in `note`."""
    folder = runtime_dir()
    records = []
    for path in sorted(folder.glob("server-*.json"), key=_mtime, reverse=True) if folder.is_dir() else []:
        try:
            record = read_record(path)
        except FileNotFoundError:
            continue  # removed as we looked: its server stopped
        except (OSError, BadRecord) as error:
            if note is not None:
                note(f"Ignored and removed {path}: {peer_text(str(error))} — not a record llmcli wrote.")
            _remove(path)
            continue
        if not _is_this_server(record):
            _remove(path)  # its server is gone; the pid may belong to another program now
            continue
        if loading or record.state == READY:
            records.append(record)
    return records


def read_record(path: Path) -> ServerRecord:
    """The record in `path`, every field checked; BadRecord says what is wrong."""
    try:
        data = json.loads(_read_small(path))
    except (ValueError, RecursionError):
        raise BadRecord("not JSON") from None
    if not isinstance(data, dict):
        raise BadRecord("not a JSON object")
    pid = data.get("pid")
    if not process_check.is_pid(pid):
        raise BadRecord(f"pid {peer_text(json.dumps(pid))[:40]} is not a process id")
    argv = data.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        raise BadRecord("no command line")
    started = data.get("started")
    if type(started) not in (int, float):
        raise BadRecord("no start time")
    url = _text(data, "url")
    port, loopback = _port(url)
    state = _text(data, "state")
    if state not in (LOADING, READY):
        raise BadRecord(f"state {peer_text(state)[:20]!r}")
    identity = data.get("model_identity")
    if identity is not None and not isinstance(identity, dict):
        raise BadRecord("model_identity is not an object")
    load = data.get("load")
    if not isinstance(load, dict):
        raise BadRecord("load is not an object")
    idle = data.get("idle_exit_s")
    if idle is not None and type(idle) not in (int, float):
        raise BadRecord("idle_exit_s is not a number")
    needs_key = data.get("needs_key")
    if not isinstance(needs_key, bool):
        raise BadRecord("needs_key is not true or false")
    models_max = data.get("models_max", 1)
    if type(models_max) is not int or models_max < 1:
        raise BadRecord("models_max is not a count")
    return ServerRecord(
        path=path,
        url=url,
        port=port,
        loopback=loopback,
        process=ProcessIdentity(pid, float(started), tuple(argv)),
        instance=_text(data, "instance"),
        state=state,
        model_spec=_text(data, "model_spec"),
        model=_text(data, "model", optional=True),
        model_path=_text(data, "model_path"),
        model_identity=identity,
        load=load,
        draft_model=_text(data, "draft_model", optional=True),
        needs_key=needs_key,
        idle_exit_s=float(idle) if idle is not None else None,
        models=_held_models(data.get("models", [])),
        models_max=models_max,
    )


def _held_models(listed: Any) -> tuple[HeldModel, ...]:
    """A record's models, each field checked as the record's own are."""
    if not isinstance(listed, list) or len(listed) > _MODELS_LISTED:
        raise BadRecord(f"models is not a list of at most {_MODELS_LISTED}")
    held = []
    for entry in listed:
        if not isinstance(entry, dict):
            raise BadRecord("a model of models is not an object")
        state = _text(entry, "state")
        if state not in _MODEL_STATES:
            raise BadRecord(f"a model's state {peer_text(state)[:20]!r}")
        size = entry.get("weight_bytes")
        if size is not None and (type(size) is not int or size < 0):
            raise BadRecord("a model's weight_bytes is not a size")
        identity = entry.get("identity")
        if identity is not None and not isinstance(identity, dict):
            raise BadRecord("a model's identity is not an object")
        held.append(HeldModel(_text(entry, "name"), _text(entry, "spec"), state, size, identity))
    return tuple(held)


def _is_this_server(record: ServerRecord) -> bool:
    """Whether the process the record describes runs, is an `llmcli serve`, and holds the
    record's port (a server binds it before it writes its first record, and keeps it to the end;
    where the system will not say, the other checks stand)."""
    return (
        is_serve_command(record.process.argv)
        and process_check.is_running(record.process)
        and process_check.listens_on(record.pid, record.port) is not False
    )


def is_serve_command(argv: tuple[str, ...]) -> bool:
    """`llmcli serve …` as a process runs it: the console script, or `python -m llmcli`."""
    head = [Path(arg).name for arg in argv[:3]]
    return "serve" in argv and any(name in ("llmcli", "llmcli.exe") for name in head)


def matching_server(model_spec: str, load: LoadSettings, note: Note | None = None) -> ServerRecord | None:
    """A running server that serves `model_spec` with the same numerics-changing settings (one
    still loading included: the caller waits for it or leaves it); else one with those settings
    that can load it by name without unloading another (it holds fewer than its --models-max)."""
    wanted = {name: asdict(load)[name] for name in _MATCHING_SETTINGS}
    records = [record for record in running_servers(note) if record.load == wanted]
    holding = [record for record in records if serves_model(record, model_spec)]
    if holding:
        return holding[0]
    if model_identity(model_spec) is not None:  # a path: no request makes a server read one
        return None
    room = [r for r in records if r.state == READY and len(r.models) < r.models_max]
    return room[0] if room and _listed(model_spec) else None


def _listed(name: str) -> bool:
    """Whether `name` is one `llmcli models list` shows: one a server loads by name."""
    from llmcli.models.catalog import model_names

    return name in model_names()


def name_on(record: ServerRecord, spec: str) -> str:
    """The name to send `record`'s server for the model `spec`: the name of the model it holds,
    or `spec` itself, a name it loads by (matching_server)."""
    for held in record.models:
        if _names(spec, held.identity, (held.spec, held.name)):
            return held.name
    return spec


def near_miss(model_spec: str, load: LoadSettings) -> tuple[ServerRecord, str] | None:
    """A running server of the same model whose settings differ, and which ones ("dtype bf16,
    here fp32"): what a command that loads in-process instead should say."""
    wanted = {name: asdict(load)[name] for name in _MATCHING_SETTINGS}
    for record in running_servers(loading=False):
        if serves_model(record, model_spec) and record.load != wanted:
            differ = [
                f"{name} {peer_text(str(record.load.get(name)))} (here {wanted[name]})"
                for name in _MATCHING_SETTINGS
                if record.load.get(name) != wanted[name]
            ]
            return record, ", ".join(differ)
    return None


def serves_model(record: ServerRecord, spec: str) -> bool:
    """Whether a running server's record is of the model `spec` names. A spec that names a file
    or folder here is matched by that file's identity (where it is, its size and time), never by
    its spelling: `-m m.gguf` in another folder is another model."""
    if record.models:  # what it holds now: the model it started with may be unloaded since
        return any(_names(spec, held.identity, (held.spec, held.name)) for held in record.models)
    return _names(spec, record.model_identity, (record.model_spec, record.model))


def _names(spec: str, identity: Any, names: tuple[Any, ...]) -> bool:
    """Whether what was recorded of a model (the identity of its file or folder, else the names
    it went by) is the model `spec` names here."""
    wanted = model_identity(spec)
    if wanted is not None:
        return identity == wanted
    return identity is None and spec in names


def model_identity(spec: str) -> dict[str, Any] | None:
    """What a path spec names, as a server and a client compare it: the resolved path, and for
    a file its size and modification time (a file replaced or rewritten is another model)."""
    path = Path(spec).expanduser()
    try:
        if not path.exists():
            return None
        resolved = path.resolve()
        found = resolved.stat()
    except (OSError, RuntimeError):
        return None
    identity: dict[str, Any] = {"path": str(resolved), "device": found.st_dev, "inode": found.st_ino}
    if resolved.is_file():
        identity.update(size=found.st_size, mtime_ns=found.st_mtime_ns)
    return identity


def loaded_path(model_spec: str) -> str:
    path = Path(model_spec).expanduser()
    with contextlib.suppress(OSError, RuntimeError):
        if path.exists():
            return str(path.resolve())
    return model_spec


def _text(data: dict[str, Any], key: str, optional: bool = False) -> Any:
    value = data.get(key)
    if (value is None and optional) or isinstance(value, str):
        return value
    raise BadRecord(f"{key} is not a text")


def _port(url: str) -> tuple[int, bool]:
    """The port of a server's URL, and whether the URL is a loopback one."""
    try:
        parts = urlsplit(url)
        port = parts.port
        host = parts.hostname or ""
    except ValueError:
        raise BadRecord("its url is not a URL") from None
    if parts.scheme != "http" or port is None:
        raise BadRecord(f"its url {peer_text(url)[:80]} is not an http URL with a port")
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    return port, loopback


def _read_small(path: Path) -> bytes:
    with path.open("rb") as handle:
        data = handle.read(_RECORD_BYTES + 1)
    if len(data) > _RECORD_BYTES:
        raise BadRecord("far larger than a record")
    return data


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
