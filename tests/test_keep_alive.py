"""--keep-alive: a call that loaded its model leaves a `llmcli serve` of it in the background, the
next call finds it, `llmcli ps` lists it, `llmcli stop` stops it, and left alone it stops by itself
once idle. Real processes, each test in its own runtime and state folders."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_helpers import LLMCLI, PATIENCE_S, one_error_line, run_cli


@pytest.fixture
def places(tmp_path: Path):
    """XDG folders of this test's own, and every server started in them killed at the end."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state")}
    (tmp_path / "run").mkdir()
    yield env
    for record in (tmp_path / "run" / "llmcli").glob("server-*.json"):
        with contextlib.suppress(OSError, ValueError, ProcessLookupError):
            os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)


def records(env: dict[str, str]) -> list[dict]:
    folder = Path(env["XDG_RUNTIME_DIR"]) / "llmcli"
    found = []
    for path in folder.glob("server-*.json") if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found


def ready(env: dict[str, str]) -> list[dict]:
    """The records of servers that have loaded (a server's record exists from its start)."""
    return [record for record in records(env) if record.get("state", "ready") == "ready"]


def wait_for(condition, what: str, timeout: float = PATIENCE_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def generate(model: Path, env: dict[str, str], *extra: str) -> dict:
    proc = run_cli(
        "generate", "-m", str(model), "--device", "cpu", "-t", "0", "-n", "6", "--json", *extra, "Hi", env=env
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_a_kept_alive_model_serves_the_next_call_until_stopped(tiny_llama: Path, places: dict) -> None:
    first = generate(tiny_llama, places, "--keep-alive", "5m")
    assert first["server"] is None  # this call loaded the model itself
    (record,) = wait_for(lambda: ready(places), "the background server's record")
    second = generate(tiny_llama, places)
    assert second["server"] == record["url"] and second["text"] == first["text"]
    listed = json.loads(run_cli("ps", "--json", env=places).stdout)
    assert [(row["pid"], row["model_spec"], row["idle_exit_s"]) for row in listed] == [
        (record["pid"], str(tiny_llama), 300.0)
    ]
    assert listed[0]["settings"] == {"device": "cpu"} and listed[0]["rss_bytes"] > 0
    assert listed[0]["idle_s"] < 60  # the second call's request touched it
    third = generate(tiny_llama, places, "--keep-alive", "5m")  # a server runs: none more
    assert third["server"] == record["url"] and len(records(places)) == 1
    stopped = run_cli("stop", str(tiny_llama), env=places)
    assert stopped.returncode == 0, stopped.stderr.decode()
    assert stopped.stdout.decode().startswith(f"stopped {record['model']} (pid {record['pid']}")
    assert records(places) == []
    log = next((Path(places["XDG_STATE_HOME"]) / "llmcli" / "logs").glob("serve-*.log")).read_text()
    assert "stops after 300 s without a request" in log


def test_a_kept_alive_server_stops_by_itself_once_idle(tiny_llama: Path, places: dict) -> None:
    server = subprocess.Popen(
        [
            *LLMCLI,
            "serve",
            "-m",
            str(tiny_llama),
            "--device",
            "cpu",
            "--port",
            "0",
            "--idle-exit",
            "1s",
            "--quiet",
        ],
        env={**os.environ, **places},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: ready(places), "the server's record")
        assert server.wait(timeout=PATIENCE_S) == 0  # nobody asked it anything for a second
        assert records(places) == []
        assert b"stops after 1 s without a request" in server.stderr.read()
    finally:
        server.kill()


def test_keep_alive_values_and_the_commands_around_it_are_checked(tiny_llama: Path, places: dict) -> None:
    bad = run_cli("generate", "-m", str(tiny_llama), "--keep-alive", "soon", "Hi", env=places)
    assert "--keep-alive: not a duration: 'soon' (examples: 90s, 5m, 1h)" in one_error_line(bad, 2)
    from_env = run_cli("generate", "-m", str(tiny_llama), "Hi", env={**places, "LLMCLI_KEEP_ALIVE": "-5m"})
    assert "LLMCLI_KEEP_ALIVE: a duration must be positive" in one_error_line(from_env, 2)
    idle = run_cli("serve", "-m", str(tiny_llama), "--idle-exit", "0s", env=places)
    assert "--idle-exit: a duration must be positive" in one_error_line(idle, 2)
    nothing = run_cli("ps", env=places)
    assert nothing.returncode == 0 and nothing.stdout == b""
    assert nothing.stderr.decode().strip() == "No llmcli server is running."
    assert json.loads(run_cli("ps", "--json", env=places).stdout) == []
    elsewhere = run_cli("generate", "--server", "http://127.0.0.1:9", "--keep-alive", "5m", "Hi", env=places)
    assert "--keep-alive keeps the model loaded here, and --server runs it there" in one_error_line(
        elsewhere, 2
    )
    missing = run_cli("stop", "no-such-model", env=places)
    assert "no llmcli server runs no-such-model" in one_error_line(missing, 1)


def test_the_background_server_gets_the_load_settings_as_flags() -> None:
    """What differs from a plain load becomes serve's flags, switches spelled both ways."""
    from llmcli.config.settings import LoadSettings
    from llmcli.frontends.keep_alive import load_flags

    assert load_flags(LoadSettings()) == []
    load = LoadSettings(device="cpu", quant="int4", double_quant=False, context_length=512, fast=False)
    assert load_flags(load) == [
        "--device",
        "cpu",
        "--quant",
        "int4",
        "--no-double-quant",
        "--ctx",
        "512",
        "--no-fast",
    ]


def test_a_background_server_that_cannot_start_is_said_once_and_the_call_goes_on(
    tiny_llama: Path, places: dict
) -> None:
    """A keep-alive server whose load fails leaves its reason; the next call of that model says
    it once and loads in-process, as it would have without keep-alive."""
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("needs a machine where --device mps fails")
    failed = run_cli(
        "serve", "-m", str(tiny_llama), "--device", "mps", "--port", "0", "--idle-exit", "5s", env=places
    )
    assert "MPS is not available" in one_error_line(failed, 1)
    said = run_cli("generate", "-m", str(tiny_llama), "--device", "cpu", "-t", "0", "-n", "4", "--json",
                   "--keep-alive", "2s", "Hi", env=places)  # fmt: skip
    assert said.returncode == 0 and json.loads(said.stdout)["server"] is None
    notes = [line for line in said.stderr.decode().splitlines() if "did not start" in line]
    assert notes == [
        f"The background server of {tiny_llama} (--keep-alive) did not start: --device mps was asked for, "
        "but MPS is not available — use --device cpu"
    ]
    again = run_cli("generate", "-m", str(tiny_llama), "--device", "cpu", "-t", "0", "-n", "4",
                    "--keep-alive", "2s", "Hi", env=places)  # fmt: skip
    assert again.returncode == 0 and b"did not start" not in again.stderr  # said once


def test_calls_made_while_a_background_server_loads_start_no_second_one(
    tiny_llama: Path, places: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Its record says it is loading from the moment it listens: a call in the meantime finds it
    loading and starts none."""
    from llmcli.config.settings import LoadSettings, RemoteSettings
    from llmcli.frontends.keep_alive import keep_alive_after

    for name, value in places.items():
        monkeypatch.setenv(name, value)
    load = LoadSettings(device="cpu")
    keep_alive_after(str(tiny_llama), load, 300, RemoteSettings())
    keep_alive_after(str(tiny_llama), load, 300, RemoteSettings())  # well before the first has loaded
    notes = capsys.readouterr().err
    assert notes.count("Keeping ") == 1 and "is still loading (pid " in notes, notes
    wait_for(lambda: ready(places), "the background server's record")
    keep_alive_after(str(tiny_llama), load, 300, RemoteSettings())  # loaded: found, nothing said
    assert capsys.readouterr().err == "" and len(records(places)) == 1
