"""The CLI through real subprocesses and pipes: input, output formats, exit codes, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from llmcli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE

from cli_helpers import LLMCLI, PATIENCE_S, run_cli
from tiny_models import TINY_CONTEXT

JSON_FIELDS = {
    "text": str,
    "model": str,
    "prompt_tokens": int,
    "completion_tokens": int,
    "finish_reason": str,
    "ttft_s": float,
    "prefill_tok_s": float,
    "decode_tok_s": float,
    "weight_bytes": int,
    "device": str,
    "dtype": str,
    "quant": str,
}


def heavy_modules_imported(stderr: bytes) -> set[str]:
    """Top-level packages named in `python -X importtime` output."""
    names = set()
    for line in stderr.decode().splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names & {"torch", "transformers", "huggingface_hub", "accelerate"}


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["generate", "--help"],
        ["chat", "--help"],
        ["models", "list", "--help"],
        ["generate", "--temperature", "-1", "hi"],
        ["ps"],
        ["stop"],
    ],
    ids=["help", "generate-help", "chat-help", "models-help", "usage-error", "ps", "stop"],
)
def test_help_and_usage_errors_import_no_heavy_modules(args: list[str]) -> None:
    proc = subprocess.run(
        [*LLMCLI[:1], "-X", "importtime", *LLMCLI[1:], *args], capture_output=True, timeout=PATIENCE_S
    )
    assert proc.returncode in (0, EXIT_USAGE)
    assert "import time:" in proc.stderr.decode()  # the probe itself works
    assert heavy_modules_imported(proc.stderr) == set()  # what keeps it fast; timed in a benchmark


def test_help_carries_examples() -> None:
    out = run_cli("generate", "--help").stdout.decode()
    assert "Examples" in out and "cat notes.txt | llmcli generate" in out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-0.5", "--temperature must be ≥ 0"),
        ("--top-p", "0", "--top-p must be in (0, 1]"),
        ("--top-p", "1.5", "--top-p must be in (0, 1]"),
        ("--top-k", "-1", "--top-k must be ≥ 0"),
        ("--min-p", "1.5", "--min-p must be in [0, 1]"),
        ("--min-p", "-0.1", "--min-p must be in [0, 1]"),
        ("--max-new-tokens", "0", "--max-new-tokens must be ≥ 1"),
        ("--repetition-penalty", "0", "--repetition-penalty must be > 0"),
        ("--temperature", "nan", "--temperature must be ≥ 0"),
        ("--dtype", "int3", "--dtype must be one of"),
    ],
)
def test_invalid_values_are_refused_before_loading(flag: str, value: str, message: str) -> None:
    # A model that does not exist: the value check must fire first.
    proc = run_cli("generate", "-m", "/nonexistent/model", flag, value, "hi")
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_USAGE
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_input_is_a_usage_error() -> None:
    proc = run_cli("generate", stdin=b"  \n\n")
    assert proc.returncode == EXIT_USAGE
    assert "prompt is empty" in proc.stderr.decode()


def test_non_utf8_stdin_is_a_usage_error() -> None:
    proc = run_cli("generate", "Summarize:", stdin=b"caf\xe9 latin-1 text")
    assert proc.returncode == EXIT_USAGE
    assert "not valid UTF-8 (byte 0xe9 at offset 3)" in proc.stderr.decode()


def test_system_with_raw_is_a_usage_error() -> None:
    proc = run_cli("generate", "--raw", "-s", "Be brief.", "hi")
    assert proc.returncode == EXIT_USAGE
    assert "--raw" in proc.stderr.decode()


def test_json_output_has_every_field(tiny_llama: Path) -> None:
    proc = run_cli(
        "generate", "-m", str(tiny_llama), "--json", "-t", "0", "-n", "12", "The capital of France is"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    for name, kind in JSON_FIELDS.items():
        assert isinstance(record[name], kind), name
    assert record["model"] == str(tiny_llama)
    assert 1 <= record["completion_tokens"] <= 12
    assert record["finish_reason"] in ("stop", "length")
    assert record["ttft_s"] > 0 and record["prefill_tok_s"] > 0
    assert record["device"] == "cpu" and record["dtype"] == "fp32" and record["quant"] == "none"


def test_stdin_is_the_material_and_arguments_the_instruction(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    from llmcli.engine.conversation import build_messages, prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    proc = run_cli(
        "generate",
        "-m",
        str(tiny_llama),
        "--json",
        "-t",
        "0",
        "-n",
        "3",
        "Summarize:",
        stdin=b"Paris is big.\n",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    # The material first: two questions about one document share its tokens (the prefix cache).
    expected = prompt_ids(tokenizer, build_messages("Paris is big.\n\nSummarize:"))
    assert json.loads(proc.stdout)["prompt_tokens"] == len(expected)


def test_piped_output_is_plain_text_and_matches_json(tiny_llama: Path) -> None:
    common = ["generate", "-m", str(tiny_llama), "-t", "0", "-n", "20", "Once upon a time"]
    plain = run_cli(*common, "--stats", env={"FORCE_COLOR": "1"})
    as_json = run_cli(*common, "--json")
    assert plain.returncode == 0 and as_json.returncode == 0
    assert b"\x1b" not in plain.stdout
    assert plain.stdout.decode() == json.loads(as_json.stdout)["text"] + "\n"
    stats_lines = plain.stderr.decode().splitlines()
    assert len(stats_lines) == 1 and "decode" in stats_lines[0] and "tok/s" in stats_lines[0]


@pytest.mark.parametrize(("args", "code"), [(["--version"], 0), (["generate", "--nope", "hi"], EXIT_USAGE)])
def test_the_quick_exit_keeps_the_exit_code_the_output_and_the_atexit_handlers(
    args: list[str], code: int
) -> None:
    """llmcli leaves without the interpreter's teardown (~1 s after a one-shot's last token):
    the exit code, everything written to stdout and stderr, and the atexit handlers (locks,
    temporary folders, logs) are kept; the buffered write is flushed, not lost."""
    import sys

    script = (
        "import atexit, sys; from llmcli.cli import main; "
        "atexit.register(lambda: print('handler ran', file=sys.stderr)); "
        "print('buffered', end=''); sys.argv[1:] = sys.argv[2:]; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "--", *args], capture_output=True, timeout=PATIENCE_S, check=False
    )
    assert proc.returncode == code, proc.stderr.decode()
    assert proc.stdout.decode().startswith("buffered")
    assert proc.stderr.decode().strip().splitlines()[-1] == "handler ran"
    if code == 0:
        assert "llmcli " in proc.stdout.decode()
    else:
        assert "no such option --nope" in proc.stderr.decode()


def test_closed_pipe_ends_quietly(tiny_llama: Path) -> None:
    proc = subprocess.Popen(
        [*LLMCLI, "generate", "-m", str(tiny_llama), "--raw", "-t", "1", "--seed", "1", "-n", "250", "x"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(1)  # like `| head -c 1`
    proc.stdout.close()
    code = proc.wait(timeout=PATIENCE_S)
    err = proc.stderr.read().decode()
    assert first
    assert code == 0
    assert err == "", err


def test_ctrl_c_exits_130_without_traceback(tiny_llama: Path) -> None:
    proc = subprocess.Popen(
        [
            *LLMCLI,
            "generate",
            "-m",
            str(tiny_llama),
            "--raw",
            "--threads",
            "1",
            "-n",
            "1000",  # long enough to be mid-reply when the signal lands, even on a busy machine
            "--seed",
            "2",
            "x",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)  # generation has started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == EXIT_INTERRUPTED
    assert b"Traceback" not in err


def test_unknown_model_fails_fast_with_one_line() -> None:
    proc = run_cli("generate", "-m", "no-such-org/no-such-model", "hi")
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_FAILURE
    assert err.count("\n") == 1 and "no-such-org/no-such-model" in err and "HF_HUB_OFFLINE" in err


def test_missing_gguf_file_is_named() -> None:
    proc = run_cli("generate", "-m", "/tmp/definitely-missing.gguf", "hi")
    assert proc.returncode == EXIT_FAILURE
    assert "/tmp/definitely-missing.gguf does not exist" in proc.stderr.decode()


def test_cuda_without_gpu_is_a_clear_error(tiny_llama: Path) -> None:
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and _cuda_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli("generate", "-m", str(tiny_llama), "--device", "cuda", "hi")
    assert proc.returncode == EXIT_FAILURE
    assert "sees no CUDA GPU" in proc.stderr.decode()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_prompt_longer_than_the_context_is_refused_with_numbers(tiny_llama: Path) -> None:
    proc = run_cli("generate", "-m", str(tiny_llama), "--raw", stdin=("word " * TINY_CONTEXT).encode())
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_FAILURE
    assert f"the model's context holds {TINY_CONTEXT}" in err and err.count("\n") == 1


def test_loading_spinner_shows_only_on_a_terminal(tiny_llama: Path) -> None:
    import pexpect

    child = pexpect.spawn(
        LLMCLI[0],
        [*LLMCLI[1:], "generate", "-m", str(tiny_llama), "-t", "0", "-n", "5", "hi"],
        env={**os.environ, "TERM": "xterm-256color"},
        timeout=PATIENCE_S,
    )
    child.expect("Loading")  # rich's status line, on the terminal's stderr
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
