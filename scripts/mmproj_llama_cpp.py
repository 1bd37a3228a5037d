"""Tiny vision projector files (tests/mmproj_files.py: written as llama.cpp's converter writes
them) handed to llama.cpp's own llama-server beside a text GGUF, one image sent through its
OpenAI chat endpoint: that llama.cpp loads the file and encodes an image with it says the
writer's names and keys are llama.cpp's, which is what models/vision/mmproj.py reads back. A dev
check, not a test: llama.cpp is not a dependency.

    python scripts/mmproj_llama_cpp.py [--llama-cpp ../shared/llama.cpp] [--text FILE] [--type F16]

--text: the text GGUF beside the projector (default: the shared Llama fixture, 256 wide; each
tiny tower is built that wide, since llama.cpp refuses a projector of another width).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mmproj_files import tiny_gemma3, tiny_qwen3vl, tiny_qwen25vl, write_mmproj

SHARED = Path(__file__).resolve().parents[2] / "shared"
# Qwen3-VL's deepstack rows widen the projector's output (llama.cpp then wants a qwen3vl text
# model of that width): beside a plain text model, the tower without them (Qwen3.5's) is checked.
TOWERS = {
    "gemma3": tiny_gemma3,
    "qwen2.5vl_merger": tiny_qwen25vl,
    "qwen3vl_merger": lambda width: tiny_qwen3vl(deepstack=(), width=width),
}


def text_width(path: Path) -> int:
    from llmcli.models.gguf_table import read_table

    table = read_table(path)
    return int(table.metadata[f"{table.architecture}.embedding_length"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def image_request(port: int) -> tuple[int, str]:
    """One chat request holding a 64 × 48 PNG: llama-server's status and what it answered."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [
        {"type": "text", "text": "What is in the image?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.dumps(json.load(answer).get("usage"))
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")[:300]


def wait_healthy(server: subprocess.Popen[bytes], port: int, limit_s: float = 120) -> bool:
    """Whether the server answers /health with 200 before it exits or `limit_s` pass."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # polling a condition (the server up), not waiting a fixed time
    return False


def check(llama_cpp: Path, text: Path, projector: Path, log: Path) -> str:
    port = free_port()
    command = [str(llama_cpp / "llama-server"), "-m", str(text), "--mmproj", str(projector)]
    command += ["-t", "2", "-c", "1024", "--host", "127.0.0.1", "--port", str(port), "-v"]
    with log.open("wb") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            if not wait_healthy(server, port):
                lines = log.read_text(errors="replace").splitlines()
                return (
                    "did not load: "
                    + " | ".join(line for line in lines if "clip" in line or "rror" in line)[-600:]
                )
            status, said = image_request(port)
            lines = log.read_text(errors="replace").splitlines()
            encoded = [line.split(": ", 1)[-1] for line in lines if "encoding batch with" in line]
            clip = " | ".join(encoded) or "no image encoded"
            return f"loaded; an image request answered {status}: {said}; clip: {clip}"
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-cpp", type=Path, default=SHARED / "llama.cpp")
    parser.add_argument("--text", type=Path, default=SHARED / "gguf-fixtures" / "fixture-F16.gguf")
    parser.add_argument("--type", default="F16", choices=["F32", "F16", "BF16", "Q8_0"])
    parser.add_argument("--only", choices=list(TOWERS))
    args = parser.parse_args()
    if not (args.llama_cpp / "llama-server").exists():
        sys.exit(f"no llama-server in {args.llama_cpp}: nothing to check against")
    width = text_width(args.text)
    with tempfile.TemporaryDirectory() as folder:
        for projector, build in TOWERS.items():
            if args.only and projector != args.only:
                continue
            path = write_mmproj(build(width=width), Path(folder) / f"mmproj-{projector}.gguf", args.type)
            print(
                f"{projector} ({args.type}): {check(args.llama_cpp, args.text, path, Path(folder) / 'log')}"
            )


if __name__ == "__main__":
    main()
