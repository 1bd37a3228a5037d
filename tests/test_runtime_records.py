"""A runtime record is data from disk: `llmcli ps`, `stop` and `generate` believe one only while
the very server it names runs (pid, start time, command line, its port), never signal or send a
prompt on the word of a file, skip a malformed one with one note, and keep working when the
runtime folder cannot be written. Real processes, each test in its own XDG folders."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import psutil
import pytest

from test_keep_alive import ready, records, wait_for

from cli_helpers import LLMCLI, PATIENCE_S, local_http_server, run_cli


@pytest.fixture
def places(tmp_path: Path) -> Iterator[dict[str, str]]:
    """XDG folders of this test's own; every process named by a record in them killed at the end."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state")}
    (tmp_path / "run" / "llmcli").mkdir(parents=True)
    yield env
    for record in records(env):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError, ProcessLookupError):
            if record["argv"][:3] == [*LLMCLI[:1], "-m", "llmcli"]:
                os.kill(record["pid"], signal.SIGKILL)


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated program, in a process group of its own, that nothing of llmcli may signal."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def write_record(env: dict[str, str], name: str, **fields: object) -> Path:
    path = Path(env["XDG_RUNTIME_DIR"]) / "llmcli" / f"server-{name}.json"
    path.write_text(json.dumps(fields))
    return path


def forged(pid: object, model: Path, url: str = "http://127.0.0.1:9", **fields: object) -> dict[str, object]:
    """A record as llmcli writes one, naming `pid`: the process's own start time and command line
    copied in where `pid` names a live process, as a forger would."""
    identity: dict[str, object] = {"started": 0.0, "argv": ["llmcli", "serve"]}
    if type(pid) is int and 0 < pid < 2**22 and psutil.pid_exists(pid):
        process = psutil.Process(pid)
        identity = {"started": process.create_time(), "argv": process.cmdline()}
    return {
        "url": url, "pid": pid, **identity, "instance": "0" * 32, "state": "ready",
        "model_spec": str(model), "model": str(model), "model_path": str(model), "model_identity": None,
        "load": {}, "draft_model": None, "needs_key": False, "idle_exit_s": None, **fields,
    }  # fmt: skip


def test_a_record_naming_another_program_is_neither_listed_nor_stopped(
    tiny_llama: Path, places: dict, bystander: subprocess.Popen[bytes]
) -> None:
    path = write_record(places, "forged", **forged(bystander.pid, tiny_llama))
    listed = run_cli("ps", "--json", env=places)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    write_record(places, "forged", **forged(bystander.pid, tiny_llama))
    stopped = run_cli("stop", env=places)
    assert stopped.returncode == 0 and stopped.stdout == b"", stopped.stderr.decode()
    assert bystander.poll() is None  # still running: not signalled
    assert not path.exists()  # a record of no llmcli server is stale: removed


@pytest.mark.parametrize(
    "pid", ["group", 0, 1, "1", 1.5, True, 99999999999999999999, -1], ids=lambda pid: repr(pid)
)
def test_a_record_whose_pid_is_no_process_id_is_skipped_with_one_note(
    tiny_llama: Path, places: dict, bystander: subprocess.Popen[bytes], pid: object
) -> None:
    """`-N` names a process group to kill(2), 0 the caller's own, -1 every process; `"1"`,
    `1.5` and `true` became PID 1; a number past any pid broke every call."""
    pid = -bystander.pid if pid == "group" else pid
    path = write_record(places, "bad", **forged(pid, tiny_llama))
    listed = run_cli("ps", "--json", env=places)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr.decode()
    notes = listed.stderr.decode().splitlines()
    if type(pid) is int and pid == 1:  # a process id, of no llmcli server: stale, removed quietly
        assert notes == [], notes
    else:
        (note,) = notes
        assert note.startswith(f"Ignored and removed {path}: pid ") and "is not a process id" in note
    assert not path.exists()  # said once: the next call says nothing
    write_record(places, "bad", **forged(pid, tiny_llama))
    if pid in (0, -1, -bystander.pid):  # in a session of its own: a regression kills only it
        stopped = subprocess.run(
            [*LLMCLI, "stop"], env={**os.environ, **places}, capture_output=True, start_new_session=True
        )
        assert stopped.returncode == 0 and stopped.stdout == b"", stopped.stderr.decode()
        assert bystander.poll() is None
        write_record(places, "bad", **forged(pid, tiny_llama))
    answered = run_cli("generate", "-m", str(tiny_llama), "-t", "0", "-n", "2", "--json", "Hi", env=places)
    assert answered.returncode == 0, answered.stderr.decode()
    assert json.loads(answered.stdout)["server"] is None


def start_server(model: Path, env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """A real `llmcli serve`, once its record says it has loaded."""
    server = subprocess.Popen(
        [*LLMCLI, "serve", "-m", str(model), "--port", "0", "--device", "cpu", "--quiet"],
        env={**os.environ, **env},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: ready(env) or server.poll() is not None, "the server's record")
        assert server.poll() is None, "the server stopped as it started"
    except BaseException:
        server.kill()  # never left running past its test
        server.wait()
        raise
    return server


def test_a_server_that_exited_but_was_not_reaped_counts_as_stopped(tiny_llama: Path, places: dict) -> None:
    """Started by a script that has not waited for it yet, a stopped server stays a zombie."""
    server = start_server(tiny_llama, places)
    try:
        stopped = run_cli("stop", env=places)
        assert stopped.returncode == 0, stopped.stderr.decode()
        assert stopped.stdout.decode().startswith("stopped "), stopped.stdout
        assert psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE  # not reaped until now
        assert records(places) == []
    finally:
        server.kill()
        server.wait()


class _Listener(http.server.BaseHTTPRequestHandler):
    """A program on another port that would answer as llmcli's /health does, and keeps what it is
    sent."""

    received: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.received.append(f"GET {self.path}")
        body = json.dumps({"status": "ok", "model": "x", "engine": "native", "instance": "0" * 32}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.received.append(f"POST {self.path}")
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_record_pointing_a_live_server_elsewhere_gets_no_prompt(tiny_llama: Path, places: dict) -> None:
    """A live llmcli server's pid, start time and command line, with another URL: the prompt
    goes nowhere but the model loaded in-process."""
    server = start_server(tiny_llama, places)
    try:
        (real,) = Path(places["XDG_RUNTIME_DIR"]).joinpath("llmcli").glob("server-*.json")
        record = json.loads(real.read_text())
        real.unlink()  # the server runs on; only the forged record names it now
        with local_http_server(_Listener) as listener:
            for url in (listener, "http://192.0.2.1:80"):
                write_record(places, "forged", **{**record, "url": url, "instance": "0" * 32})
                proc = run_cli(
                    "generate", "-m", str(tiny_llama), "--device", "cpu", "-t", "0", "-n", "2", "--json",
                    "Hi",
                    env=places,
                )  # fmt: skip
                assert proc.returncode == 0, proc.stderr.decode()
                assert json.loads(proc.stdout)["server"] is None
        assert _Listener.received == []
    finally:
        server.kill()
        server.wait()


def test_a_relative_path_is_matched_by_the_file_it_names_not_its_spelling(
    tiny_llama: Path, places: dict, tmp_path: Path
) -> None:
    """`-m m` in folder B is not answered by a server of folder A's `m`; the same folder named
    another way is."""
    for folder in ("a", "b"):
        shutil.copytree(tiny_llama, tmp_path / folder / "m")
    server = start_server(Path("m"), places, cwd=tmp_path / "a")
    try:
        url = ready(places)[0]["url"]
        elsewhere = subprocess.run(
            [*LLMCLI, "generate", "-m", "m", "--device", "cpu", "-t", "0", "-n", "2", "--json", "Hi"],
            env={**os.environ, **places}, cwd=tmp_path / "b", capture_output=True, timeout=PATIENCE_S,
        )  # fmt: skip
        assert elsewhere.returncode == 0, elsewhere.stderr.decode()
        assert json.loads(elsewhere.stdout)["server"] is None
        same = run_cli(
            "generate",
            "-m",
            str(tmp_path / "a" / "m"),
            "--device",
            "cpu",
            "-n",
            "2",
            "--json",
            "Hi",
            env=places,
        )
        assert same.returncode == 0 and json.loads(same.stdout)["server"] == url, same.stderr.decode()
    finally:
        server.kill()
        server.wait()


def test_a_background_server_is_listed_found_and_stoppable_while_it_loads(
    tiny_llama: Path, places: dict
) -> None:
    """The README's sequence run as a script, with no pause: the second call uses the server the
    first left, `ps` lists it at once, and `stop` stops it."""
    call = ("generate", "-m", str(tiny_llama), "--device", "cpu", "-t", "0", "-n", "4", "--json", "Hi")
    first = run_cli(*call, "--keep-alive", "5m", env=places)
    assert first.returncode == 0, first.stderr.decode()
    listed = json.loads(run_cli("ps", "--json", env=places).stdout)
    assert [row["model_spec"] for row in listed] == [str(tiny_llama)]
    second = run_cli(*call, env=places)
    assert second.returncode == 0, second.stderr.decode()
    assert json.loads(second.stdout)["server"] == listed[0]["url"]
    assert json.loads(second.stdout)["text"] == json.loads(first.stdout)["text"]
    again = run_cli(*call, "--keep-alive", "5m", env=places)
    stopped = run_cli("stop", env=places)
    assert stopped.returncode == 0 and stopped.stdout.decode().startswith("stopped "), stopped.stderr.decode()
    assert records(places) == [] and again.returncode == 0


def test_a_server_still_loading_is_stopped_by_llmcli_stop(tiny_llama: Path, places: dict) -> None:
    first = run_cli("generate", "-m", str(tiny_llama), "-n", "2", "--keep-alive", "5m", "Hi", env=places)
    assert first.returncode == 0, first.stderr.decode()
    (record,) = records(places)  # there as soon as the call has ended, loading or loaded
    stopped = run_cli("stop", env=places)
    assert stopped.returncode == 0, stopped.stderr.decode()
    assert stopped.stdout.decode().startswith("stopped "), stopped.stdout
    assert not psutil.pid_exists(record["pid"]) or psutil.Process(record["pid"]).status() == "zombie"
    assert records(places) == []


def test_a_runtime_folder_that_cannot_be_written_is_said_once_and_everything_goes_on(
    tiny_llama: Path, places: dict, tmp_path: Path
) -> None:
    """Full, read-only or not a folder: keep-alive and discovery are conveniences. (A file where
    the folder should be: root writes through read-only modes.)"""
    runtime = Path(places["XDG_RUNTIME_DIR"]) / "llmcli"
    runtime.rmdir()
    runtime.write_text("not a folder")
    kept = run_cli(
        "generate", "-m", str(tiny_llama), "-t", "0", "-n", "2", "--keep-alive", "5m", "Hi", env=places
    )
    assert kept.returncode == 0 and kept.stdout.strip(), kept.stderr.decode()
    assert kept.stderr.decode().count("Cannot keep ") == 1 and "unexpected" not in kept.stderr.decode()
    server = subprocess.Popen(
        [*LLMCLI, "serve", "-m", str(tiny_llama), "--port", "0", "--device", "cpu", "--quiet"],
        env={**os.environ, **places},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        said = server.stderr.readline().decode()
        assert said.startswith("Cannot write this server's record in "), said
        serving = server.stderr.readline().decode()
        assert serving.startswith("Serving "), serving
        url = serving.split(" at ", 1)[1].split("/v1", 1)[0]
        answered = run_cli("generate", "--server", url, "-t", "0", "-n", "2", "Hi", env=places)
        assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr.decode()
    finally:
        server.terminate()
        assert server.wait(timeout=PATIENCE_S) == 0
    assert not list(runtime.parent.glob("**/*.tmp"))
    state = Path(places["XDG_STATE_HOME"])
    shutil.rmtree(state, ignore_errors=True)
    state.write_text("not a folder")  # the log and lock folders cannot be made either
    runtime.unlink()
    kept = run_cli(
        "generate", "-m", str(tiny_llama), "-t", "0", "-n", "2", "--keep-alive", "5m", "Hi", env=places
    )
    assert kept.returncode == 0 and kept.stdout.strip(), kept.stderr.decode()
    assert "Cannot keep " in kept.stderr.decode() and "unexpected" not in kept.stderr.decode()
