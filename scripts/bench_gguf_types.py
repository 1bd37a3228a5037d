"""GGUF files of several types made from the demo, each as llmcli reads it: the load (the median
of three first ones, each on an empty cache, against three later ones), what the cache gains,
the weights held against the file, decode speed and perplexity on scripts/data/quality.txt
(beside an exact reader's: every tensor dequantized by gguf, run in fp32) — one table, the
files interleaved. Where llama-cpp-python is installed (in a venv of its own: `pip install
llama-cpp-python`, which compiles llama.cpp), its decode speed and perplexity on the same files
and token ids are columns beside llmcli's.

The files are written once into --dir with gguf's own writer and quantizer from the demo's
weights (its Q4_1 blocks dequantized: F16, Q8_0, Q5_0, Q4_0 — the types gguf's Python quantizer
makes), and Q4_K_M by llama.cpp's own quantizer where llama-cpp-python is installed.

  python scripts/bench_gguf_types.py [--dir /tmp/llmcli-demo-types] [--runs 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_files import rewrite_gguf
from llama_cpp_reference import perplexity

QUALITY_TEXT = Path(__file__).parent / "data" / "quality.txt"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TYPES = ("F16", "Q8_0", "Q5_0", "Q4_0")
# One load in a process of its own: resolve (a first one reads the tokenizer) and load, timed.
LOAD = """
import sys, time
from llmcli.config.settings import LoadSettings
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model
start = time.perf_counter()
load_model(resolve_model(sys.argv[1]), LoadSettings(device="cpu"), lean=True)
print(time.perf_counter() - start)
"""


def make_types(demo: Path, folder: Path) -> list[Path]:
    """The demo's 2-D weights written again as each type (its other tensors as they are)."""
    import gguf
    from gguf.quants import dequantize, quantize

    folder.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(demo))
    made = []
    for name in TYPES:
        target = folder / f"{demo.stem.rsplit('.', 1)[0]}.{name}.gguf"
        if not target.is_file():
            kind = gguf.GGMLQuantizationType[name]
            retype = {}
            for tensor in reader.tensors:
                if len(tensor.shape) != 2:
                    continue
                values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
                data = values.astype(np.float16) if name == "F16" else quantize(values, kind)
                retype[tensor.name] = (kind, data)
            staging = target.with_suffix(".partial")
            rewrite_gguf(demo, staging, retype=retype, metadata={"general.file_type": _file_type(name)})
            staging.rename(target)
        made.append(target)
    return made


def make_k_quant(f16: Path, name: str = "Q4_K_M") -> Path:
    """The F16 file quantized by llama.cpp's own quantizer (its Python binding), where installed:
    gguf's Python quantizer has no K types. (On the demo, width 576, llama.cpp falls back to
    Q5_0/Q8_0 for most tensors: its Q4_K_M is that mix, as a user's would be.)"""
    import ctypes

    import llama_cpp

    target = f16.with_name(f16.name.replace(".F16.", f".{name}."))
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        staging = target.with_suffix(".partial")
        done = llama_cpp.llama_model_quantize(str(f16).encode(), str(staging).encode(), ctypes.byref(params))
        if done != 0:
            raise RuntimeError(f"llama.cpp could not quantize {f16} to {name}")
        staging.rename(target)
    return target


def _file_type(name: str) -> int:
    import gguf

    return int(gguf.LlamaFileType[f"MOSTLY_{name}"])


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits at every position of `ids` (the same token ids as llmcli's), as the
    fixtures' references were made: one batch, 2 threads."""
    from llama_cpp import Llama

    model = Llama(
        model_path=str(path),
        n_ctx=len(ids) + 8,
        n_batch=len(ids) + 8,
        n_threads=2,
        logits_all=True,
        verbose=False,
    )
    model.eval(ids)
    return torch.from_numpy(np.array(model.scores[: len(ids)], dtype=np.float32))


def load_seconds(path: Path, cache: Path) -> float:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(path)], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "llmcli-demo-types")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from llmcli.config.settings import LoadSettings
    from llmcli.engine.bench import interleaved_times, ours
    from llmcli.engine.conversation import build_messages, prompt_ids
    from llmcli.engine.loop import Engine
    from llmcli.models.load import load_model
    from llmcli.models.resolve import demo_gguf_path, resolve_model

    demo = demo_gguf_path()
    files = [demo, *make_types(demo, args.dir)]
    if importlib.util.find_spec("llama_cpp") is not None:
        files.append(make_k_quant(next(path for path in files if ".F16." in path.name)))
    rows: dict[str, dict[str, object]] = {}
    makers = {}
    with tempfile.TemporaryDirectory(prefix="llmcli-bench-gguf-") as scratch:
        for path in files:
            cache = Path(scratch) / path.stem
            # Each first load on an empty cache of its own; the last of them is kept for the later loads.
            firsts = [load_seconds(path, Path(scratch) / f"{path.stem}-first-{i}") for i in range(2)]
            firsts.append(load_seconds(path, cache))
            later = [load_seconds(path, cache) for _ in range(3)]
            os.environ["XDG_CACHE_HOME"] = str(cache)
            loaded = load_model(resolve_model(str(path)), LoadSettings(device="cpu"), lean=True)
            engine = Engine.for_loaded(dataclasses.replace(loaded, eos_token_ids=frozenset()))
            text_ids = loaded.tokenizer.encode(QUALITY_TEXT.read_text())
            # The exact reader beside it: every tensor dequantized by gguf, run in fp32.
            exact = load_model(
                resolve_model(str(path)), LoadSettings(device="cpu", quant="none", dtype="fp32")
            )
            with torch.inference_mode():
                logits = engine.backend.score(text_ids).float()
                exact_logits = Engine.for_loaded(exact).backend.score(text_ids).float()
            del exact
            prompt = prompt_ids(loaded.tokenizer, build_messages(PROMPT))
            for n in (1, args.tokens):
                makers[f"{path.stem}/{n}"] = ours(engine, prompt, n)
            rows[path.stem] = {
                "held as": f"{loaded.dtype_name} {loaded.quant}",
                "held / file": loaded.weight_bytes / path.stat().st_size,
                "first load s": statistics.median(firsts),
                "later load s": statistics.median(later),
                "cache MB": folder_bytes(cache / "llmcli") / 1e6,
                "ppl": perplexity(logits, np.asarray(text_ids)),
                "exact reader ppl": perplexity(exact_logits, np.asarray(text_ids)),
            }
            if importlib.util.find_spec("llama_cpp") is not None:
                theirs = llama_cpp_logits(path, text_ids)
                rows[path.stem]["llama.cpp ppl"] = perplexity(theirs, np.asarray(text_ids))
        if importlib.util.find_spec("llama_cpp") is not None:
            from bench_gguf import llama_cpp_run

            for path in files:
                run = llama_cpp_run(str(path), prompt, torch.get_num_threads())
                for n in (1, args.tokens):
                    makers[f"llama.cpp {path.stem}/{n}"] = run(n)
        times = interleaved_times(makers, args.runs, torch.device("cpu"))
    for path in files:
        for prefix, column in (("", "decode tok/s"), ("llama.cpp ", "llama.cpp tok/s")):
            key = f"{prefix}{path.stem}"
            if f"{key}/1" in times:
                rates = [
                    (args.tokens - 1) / (b - a)
                    for a, b in zip(times[f"{key}/1"], times[f"{key}/{args.tokens}"], strict=True)
                ]
                rows[path.stem][column] = rates
    print(
        f"\ncpu · {torch.get_num_threads()} threads · {args.tokens} new tokens · "
        f"median (lowest–highest) of {args.runs}"
    )
    columns = [
        "held as",
        "held / file",
        "first load s",
        "later load s",
        "cache MB",
        "decode tok/s",
        "llama.cpp tok/s",
        "ppl",
        "llama.cpp ppl",
        "exact reader ppl",
    ]
    print("| file | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, row in rows.items():
        cells = [_cell(row.get(column)) for column in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(
        json.dumps(
            {name: {k: v for k, v in row.items() if not isinstance(v, list)} for name, row in rows.items()}
        )
    )


def _cell(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return f"{statistics.median(value):.1f} ({min(value):.1f}–{max(value):.1f})"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


if __name__ == "__main__":
    main()
