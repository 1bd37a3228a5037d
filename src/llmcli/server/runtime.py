"""Where a running `llmcli serve` says it is, and how `generate` finds one that fits its request.

The server writes one JSON file per process into the runtime dir ($XDG_RUNTIME_DIR/llmcli, else
the state dir): its URL, pid, the model as asked and as resolved, and the load settings that
change what it computes. A file whose process is gone is stale: skipped (and removed), at the
cost of a `kill -0`, never a network timeout. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmcli.config.paths import state_dir
from llmcli.config.settings import LoadSettings

# Settings that change the numbers a model computes; threads, offload or --fast change only speed.
_MATCHING_SETTINGS = ("device", "dtype", "quant", "quant_type", "double_quant", "context_length", "engine")


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "llmcli" if base else state_dir() / "run"


def record_path(pid: int | None = None) -> Path:
    return runtime_dir() / f"server-{pid or os.getpid()}.json"


def write_record(
    url: str,
    model_spec: str,
    model_name: str,
    model_path: str,
    load: LoadSettings,
    draft_model: str | None = None,
    needs_key: bool = False,
    idle_exit_s: float | None = None,
) -> Path:
    """Announce this process's server; atomic, so a reader sees all of it or nothing."""
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = {
        "url": url,
        "pid": os.getpid(),
        "model_spec": model_spec,
        "model": model_name,
        "model_path": model_path,
        "load": {name: asdict(load)[name] for name in _MATCHING_SETTINGS},
        "draft_model": draft_model,  # what `--speculative draft` through this server drafts with
        "needs_key": needs_key,  # started with --api-key: a client without one is refused
        "idle_exit_s": idle_exit_s,  # a keep-alive server stops after this long without a request
    }
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(record))
    os.replace(staging, path)
    return path


def write_failure(model_spec: str, error: BaseException) -> Path:
    """A keep-alive server that could not start leaves why, for the next call to say once."""
    from llmcli.errors import LlmcliError

    reason = error.one_line() if isinstance(error, LlmcliError) else f"{type(error).__name__}: {error}"
    path = runtime_dir() / f"failed-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(json.dumps({"model_spec": model_spec, "error": reason.splitlines()[0] if reason else ""}))
    return path


def take_failures(model_spec: str) -> list[str]:
    """The reasons keep-alive servers of `model_spec` could not start, each given out once."""
    folder = runtime_dir()
    reasons = []
    for path in sorted(folder.glob("failed-*.json")) if folder.is_dir() else []:
        try:
            failure = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _same_model(model_spec, {failure.get("model_spec")}):
            reasons.append(str(failure.get("error") or "unknown"))
            with contextlib.suppress(OSError):
                path.unlink()
    return reasons


def remove_record() -> None:
    with contextlib.suppress(OSError):
        record_path().unlink()


def running_servers() -> list[dict[str, Any]]:
    """The records of servers whose process is alive, newest first; stale ones are removed."""
    folder = runtime_dir()
    records = []
    for path in sorted(folder.glob("server-*.json"), key=_mtime, reverse=True) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            alive = is_alive(int(record["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if alive:
            records.append(record)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return records


def matching_server(model_spec: str, load: LoadSettings) -> dict[str, Any] | None:
    """A running server that serves `model_spec` with the same numerics-changing settings."""
    wanted = {name: asdict(load)[name] for name in _MATCHING_SETTINGS}
    for record in running_servers():
        names = {record.get("model_spec"), record.get("model"), record.get("model_path")}
        if _same_model(model_spec, names) and record.get("load") == wanted:
            return record
    return None


def near_miss(model_spec: str, load: LoadSettings) -> tuple[dict[str, Any], str] | None:
    """A running server of the same model whose settings differ, and which ones ("dtype bf16,
    here fp32"): what a command that loads in-process instead should say."""
    wanted = {name: asdict(load)[name] for name in _MATCHING_SETTINGS}
    for record in running_servers():
        names = {record.get("model_spec"), record.get("model"), record.get("model_path")}
        served = record.get("load") or {}
        if _same_model(model_spec, names) and served != wanted:
            differ = [
                f"{name} {served.get(name)} (here {wanted[name]})"
                for name in _MATCHING_SETTINGS
                if served.get(name) != wanted[name]
            ]
            return record, ", ".join(differ)
    return None


def serves_model(record: dict[str, Any], spec: str) -> bool:
    """Whether a running server's record is of the model `spec` names."""
    return _same_model(spec, {record.get("model_spec"), record.get("model"), record.get("model_path")})


def _same_model(spec: str, names: set[Any]) -> bool:
    if spec in names:
        return True
    path = Path(spec).expanduser()
    with contextlib.suppress(OSError):
        if path.exists():
            return str(path.resolve()) in {str(Path(n).resolve()) for n in names if isinstance(n, str)}
    return False


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, though probably not ours to use
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
