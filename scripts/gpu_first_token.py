"""One-shot first token from the page cache, with where the time goes: a config's shapes with
random weights saved as a model folder (safetensors, and a word-per-id tokenizer so that every
token the random model writes prints), then `llmcli generate` on it as a script would call it —
the first byte on stdout timed from the process's start — and the same start in-process, stage
by stage (interpreter, torch, llmcli, the load, the engine with its graph capture, the first
token). Prints one JSON object; the folder is removed at the end.

    python scripts/gpu_first_token.py --config configs/llama-3.2-1b.json --device cuda

The folder is written just before, so its pages are in the page cache, as they are for a model
used a moment ago. One call warms what a first call does once (bytecode, llmcli's cache), and is
reported beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_oneshot import timed

# Words, not token ids: the one-shot reads its prompt as text (--raw: a folder of random weights
# has no chat template worth timing).
PROMPT = " ".join(f"w{index}" for index in range(3, 67))


def word_tokenizer(vocab_size: int) -> object:
    """A tokenizer of one word per id ("w0" … ): whatever id a random model writes decodes to
    visible text, so the first token is the first byte on stdout."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{index}": index for index in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")


def save_random_model(config: str, device: str, folder: Path) -> None:
    """`config`'s shapes with random weights (as `bench --random-weights` builds them) saved to
    `folder`, end-of-sequence unset so that every run writes its tokens."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_random

    loaded = load_random(config, LoadSettings(device=device))
    model = loaded.model
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    word_tokenizer(model.config.get_text_config().vocab_size).save_pretrained(folder)
    del loaded, model
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # the one-shots after it load their own copy on the same card


def one_shot(folder: Path, device: str, new_tokens: int) -> dict[str, float]:
    command = [sys.executable, "-m", "llmcli", "generate", "-m", str(folder), "--device", device]
    command += ["-t", "0", "-n", str(new_tokens), "--raw", PROMPT]
    return timed(command, dict(os.environ), "llmcli generate")


def breakdown(folder: Path, device: str, spawned: float) -> dict[str, float]:
    """The one-shot's start in this process, stage by stage: seconds each, from `spawned` (the
    wall clock when the parent started this process)."""
    marks = {"interpreter": time.time() - spawned}
    start = time.perf_counter()

    def mark(stage: str) -> None:
        nonlocal start
        now = time.perf_counter()
        marks[stage] = now - start
        start = now

    import torch  # noqa: F401  (its import is a stage of its own)

    mark("import torch")
    from llmcli.config.settings import LoadSettings, SamplingParams
    from llmcli.frontends.loading import engine_with_feedback, load_with_feedback

    mark("import llmcli")
    loaded = load_with_feedback(str(folder), LoadSettings(device=device), lean=True)
    mark("load")
    engine = engine_with_feedback(loaded)
    mark("engine (graph capture)")
    ids = loaded.tokenizer.encode(PROMPT)
    engine.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=1))
    mark("first token")
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a config.json (random weights of its shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scratch", type=Path, help="where the folder is written (default: a temporary one)")
    parser.add_argument("-n", "--new-tokens", type=int, default=8)
    parser.add_argument("--breakdown", type=Path, help=argparse.SUPPRESS)  # the in-process child
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.breakdown:
        print(json.dumps(breakdown(args.breakdown, args.device, args.spawned)))
        return
    if args.scratch:
        args.scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="first-token-", dir=args.scratch))
    try:
        started = time.perf_counter()
        save_random_model(args.config, args.device, folder)
        saved_s = time.perf_counter() - started
        weights = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
        first = one_shot(folder, args.device, args.new_tokens)
        measured = one_shot(folder, args.device, args.new_tokens)
        child = [sys.executable, __file__, "--config", args.config, "--device", args.device]
        child += ["--breakdown", str(folder), "--spawned", str(time.time())]
        stages = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record = {
        "config": args.config,
        "device": args.device,
        "weight_bytes": weights,
        "saved_s": saved_s,
        "first_byte_s": measured["first_byte_s"],
        "wall_s": measured["wall_s"],
        "first_call_first_byte_s": first["first_byte_s"],
        "breakdown_s": stages,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
