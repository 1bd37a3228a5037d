"""A tiny Qwen3.5 GGUF file (tests/gguf_qwen35.py: written as llama.cpp's converter writes one)
run by llama.cpp and by llmcli: that llama.cpp loads and runs the file says the writer writes a
real `qwen35` file (`qwen35moe`, `qwen3next` with --arch; `gemma4` with --arch gemma4 or
gemma4_moe, written by tests/gguf_gemma4.py), and the two perplexities on the same text,
computed the same way, say that llmcli reads it as llama.cpp does. A dev check, not a test:
llama.cpp is not a dependency.

Measured with ../shared/llama.cpp (llama-cpp-python 0.3.36's tree), --context 32: `gemma4` F32
within +0.05 … +0.18 % of llama.cpp chunk by chunk, `gemma4_moe` within −0.35 … +1.03 % (llama.cpp
loads both files as written, so the writer's names and metadata are ones it reads; the small
steady gap is not explained yet: ggml's GELU is a table lookup on the CPU, one candidate).

    python scripts/gguf_qwen35_llama_cpp.py [--llama-cpp ../shared/llama.cpp] [--half] [--type Q4_0]
        [--arch qwen3_5|qwen3_5_moe|qwen3_next|gemma4|gemma4_moe] [--quant none]

--type: the file quantized by llama.cpp's llama-quantize to that type, and both run on that.

Perplexity as llama-perplexity computes it: the token ids in chunks of --context, each scored
on its second half (the logits at positions n/2 … n−2 against the next token), no BOS added
(Qwen's files add none). llama-perplexity here prints each chunk's running figure but may stop
before the last (and its final estimate) without a word: the chunks it printed are compared.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_gemma4 import write_gemma4_gguf
from gguf_qwen35 import tiny_qwen35, write_qwen35_gguf

from tiny_models import CORPUS, build_tiny_model


def llmcli_perplexities(path: Path, text: str, context: int, quant: str) -> tuple[list[float], int]:
    """The perplexity after each chunk (over the chunks so far, as llama-perplexity prints it),
    and the text's token count."""
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    settings = LoadSettings(device="cpu", dtype="fp32", threads=2, engine="native", quant=quant)
    loaded = load_model(resolve_model(str(path)), settings, lean=True)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    first, total, count, after = context // 2, 0.0, 0, []
    with torch.inference_mode():
        for chunk in range(len(ids) // context):
            tokens = ids[chunk * context : (chunk + 1) * context]
            logits = NativeBackend(loaded.model, context).score(tokens).double()
            rows = torch.log_softmax(logits[first : context - 1], dim=-1)
            total -= float(rows[torch.arange(context - 1 - first), torch.tensor(tokens[first + 1 :])].sum())
            count += context - 1 - first
            after.append(math.exp(total / count))
    return after, len(ids)


def llama_cpp_perplexities(binary: Path, path: Path, text_file: Path, context: int) -> list[float]:
    """What llama-perplexity prints after each chunk ("[1]1576.9452,[2]…")."""
    command = [str(binary), "-m", str(path), "-f", str(text_file), "-t", "2", "-c", str(context)]
    proc = subprocess.run([*command, "-b", str(context)], capture_output=True, text=True, timeout=300)
    found = [float(value) for value in re.findall(r"\[\d+\]([\d.]+),", proc.stdout + proc.stderr)]
    if not found:
        raise SystemExit(
            f"llama-perplexity printed no perplexity (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "shared" / "llama.cpp"
    parser.add_argument("--llama-cpp", type=Path, default=default)
    parser.add_argument("--half", action="store_true", help="an F16 file (default F32)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--type", help="quantize the file with llama-quantize to this type first")
    parser.add_argument(
        "--arch", default="qwen3_5", choices=["qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma4", "gemma4_moe"]
    )
    parser.add_argument("--quant", default="auto", help="llmcli's --quant (none: a quantized file's floats)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmcli-qwen35-gguf-"))
    os.environ["XDG_CACHE_HOME"] = str(work / "cache")
    if args.arch.startswith("gemma4"):
        path = write_gemma4_gguf(
            build_tiny_model(work / args.arch, args.arch), work / "gemma4.gguf", half=args.half
        )
    else:
        path = write_qwen35_gguf(
            tiny_qwen35(work / args.arch, args.arch), work / "qwen35.gguf", half=args.half
        )
    if args.type:
        quantized = work / f"qwen35-{args.type}.gguf"
        command = [str(args.llama_cpp / "llama-quantize"), str(path), str(quantized), args.type]
        subprocess.run(command, capture_output=True, check=True, timeout=300)
        path = quantized
    text = " ".join(CORPUS[:4]) * 3
    text_file = work / "text.txt"
    text_file.write_text(text)
    theirs = llama_cpp_perplexities(args.llama_cpp / "llama-perplexity", path, text_file, args.context)
    ours, count = llmcli_perplexities(path, text, args.context, args.quant)
    print(f"{count} tokens by llmcli's tokenizer; perplexity after each chunk of {args.context}:")
    for chunk, (their, our) in enumerate(zip(theirs, ours, strict=False), start=1):
        print(f"  [{chunk}] llama.cpp {their:.4f}  llmcli {our:.4f}  ({100 * (our / their - 1):+.3f} %)")


if __name__ == "__main__":
    main()
