"""Time to first token for one 896×896 image on the CPU: llmcli (its image table, transformers'
vision tower, the native decoder) against transformers' whole model, end to end, in one process,
the runs of both interleaved; and what the vision tower's share of each is.

The model is Qwen3.5-0.8B's shape with random weights, built offline into --folder (kept and
reused when it is there): the language model of configs/qwen3.5-0.8b.json inside a
Qwen3_5ForConditionalGeneration with the released 0.8B checkpoint's vision config (VISION_0_8B:
not transformers' Qwen3_5VisionConfig defaults, which are the larger checkpoints' 27 × 1152
tower), a small trained tokenizer holding Qwen's vision tokens, and the released
preprocessor_config.json's pixel bounds, so an 896×896 image is 56×56 patches of 16, merged
2×2 into 28×28 = 784 image tokens.

    python scripts/bench_vision.py [--runs 5] [--threads 2] [--dtype fp32] [--depth 12]

On a machine others share, --threads 1: a thread stuck behind another process stalls every
matmul of a 2-thread run (models/device.py), and the spread grows tenfold.

Each run takes a new random image (new bytes, so llmcli's image table cannot find it by
content): llmcli turns the chat into ids (opening the image, its processor, the placeholder),
then generates one token on a fresh engine (the tower runs on the prefill's first need of the
rows); transformers decodes the image, runs the image processor (the PIL one: the fast one needs
torchvision) and expands the template's marker as Qwen3VLProcessor does, then calls
`model(...)` with logits_to_keep=1, as generate does, and takes the argmax. The vision tower is
timed by hooks on the tower module in both (the same transformers module: llmcli runs it).
Then the second request with an image already seen: the same chat again on the same engine (the
prefix cache holds the prompt), and the same image under another question on a fresh engine (the
table holds the image's rows: no tower, the decoder prefills everything).

Reported: median (lowest–highest) of --runs runs after one warm-up of each, and the 1-minute
load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import VISION_TEMPLATE, VISION_TOKENS, train_tokenizer  # noqa: E402

SIDE = 896
# Qwen3.5-0.8B's released vision_config (its config.json): 12 blocks of 768, 12 heads, patches
# of 16 merged 2×2 into rows as wide as the decoder (1024). transformers' defaults differ.
VISION_0_8B = {
    "depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 1024,
    "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": [],
}  # fmt: skip
# The released preprocessor_config.json's bounds (65536 to 16777216 pixels, normalised to [-1, 1]).
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
}  # fmt: skip
QUESTION = "Describe this image."
OTHER_QUESTION = "What colour is the top left corner?"


def build_model(folder: Path, depth: int) -> Path:
    """Qwen3.5-0.8B's shape with random weights, saved in fp32 with its tokenizer and image
    processor settings; an existing build of the same depth is reused."""
    marker = folder / "bench_vision.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"depth": depth}:
        return folder
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tokenizer = train_tokenizer(special=VISION_TOKENS)
    tokenizer.chat_template = VISION_TEMPLATE
    text = json.loads((ROOT / "configs" / "qwen3.5-0.8b.json").read_text())
    for key in ("architectures", "model_type", "torch_dtype"):
        text.pop(key)
    # The tokenizer's ids stand in for the released ones (all below the 248320 of the vocabulary).
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    text |= {"eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}
    start, pad, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = Qwen3_5Config(
        text_config=text,
        vision_config=VISION_0_8B | {"depth": depth},
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = eos
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    marker.write_text(json.dumps({"depth": depth}))
    return folder


def png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((SIDE, SIDE, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


class TowerClock:
    """Seconds spent in a vision tower module's forward (hooks: the module itself is untouched)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.spent = 0.0
        self._started = 0.0
        tower.register_forward_pre_hook(self._start)
        tower.register_forward_hook(self._stop)

    def _start(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.spent += time.perf_counter() - self._started

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


@dataclass
class Phases:
    """One run's seconds: preparing the inputs, the vision tower, and the whole to first token."""

    prepare: float
    tower: float
    total: float
    prefilled: int = 0  # the prompt's tokens the decoder ran (the rest came from the cache)

    @property
    def decoder(self) -> float:
        return self.total - self.prepare - self.tower


@dataclass
class Column:
    runs: list[Phases] = field(default_factory=list)


@contextmanager
def clock() -> Iterator[Callable[[], float]]:
    start = time.perf_counter()
    yield lambda: time.perf_counter() - start


class Llmcli:
    """llmcli in-process: the loaded model (native engine), its image table, an engine per request."""

    def __init__(self, folder: Path, dtype: str, threads: int) -> None:
        from llmcli.config.settings import LoadSettings
        from llmcli.models.load import load_model
        from llmcli.models.resolve import resolve_model

        settings = LoadSettings(device="cpu", dtype=dtype, threads=threads, engine="native")
        self.loaded = load_model(resolve_model(str(folder)), settings, lean=True)
        self.tower: TowerClock | None = None

    def build_tower(self) -> float:
        """Build the vision tower now (as the first image would), hooked: the seconds it took."""
        with clock() as built:
            tower = self.loaded.vision.encoder().tower
        self.tower = TowerClock(tower)
        return built()

    def messages(self, image: bytes, question: str) -> list[dict[str, Any]]:
        from llmcli.models.vision.encoder import ImageInput

        content = [
            {"type": "image", "image": ImageInput(image, "bench.png")},
            {"type": "text", "text": question},
        ]
        return [{"role": "user", "content": content}]

    def engine(self) -> Any:
        from llmcli.engine.loop import Engine

        return Engine.for_loaded(self.loaded)

    def request(self, engine: Any, image: bytes, question: str = QUESTION) -> tuple[Phases, int]:
        """One chat with `image` to its first token on `engine`: the phases, and the token."""
        from llmcli.config.settings import SamplingParams
        from llmcli.engine.conversation import prompt_ids
        from llmcli.engine.image_rows import table_of

        table = table_of(self.loaded)
        with clock() as total:
            ids = prompt_ids(self.loaded.tokenizer, self.messages(image, question), images=table)
            prepare = total()
            result = engine.complete(ids, SamplingParams(max_new_tokens=1))
            spent = total()
        assert self.tower is not None, "build_tower first"
        prefilled = result.stats.prefilled_tokens
        return Phases(prepare, self.tower.take(), spent, prefilled), result.token_ids[0]


class Transformers:
    """transformers' whole model, its inputs made as Qwen3VLProcessor makes them: the PIL image
    processor (Qwen3VLProcessor itself will not build without a video processor, which needs
    torchvision), then `<|image_pad|>` repeated once per merged patch in the template's text."""

    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        settings = {key: value for key, value in PREPROCESSOR.items() if key != "image_processor_type"}
        self.image_processor = Qwen2VLImageProcessorPil(**settings)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
        self.tower = TowerClock(self.model.model.visual)

    def request(self, image: bytes) -> tuple[Phases, int]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        pad = VISION_TOKENS[1]
        with clock() as total, torch.inference_mode():
            picture = Image.open(io.BytesIO(image)).convert("RGB")
            pixels = dict(self.image_processor(images=[picture], return_tensors="pt"))
            rows = int(pixels["image_grid_thw"].prod()) // self.image_processor.merge_size**2
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = dict(self.tokenizer([text.replace(pad, pad * rows)], return_tensors="pt")) | pixels
            # the processor's mask of image tokens (1), which multimodal RoPE reads
            image_id = self.model.config.image_token_id
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_id).long()
            prepare = total()
            logits = self.model(**inputs, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            spent = total()
        return Phases(prepare, self.tower.take(), spent), token


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [value * scale for value in values]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def load() -> float:
    return os.getloadavg()[0]


# What a second request with an image already seen costs llmcli, each after a first request
# with the image on a fresh engine: (row, question, on the first request's engine).
SECOND_REQUESTS = {
    "the same chat again (the prefix cache holds it)": (QUESTION, True),
    "the same image, another question, same engine (from the cache's last checkpoint)": (
        OTHER_QUESTION,
        True,
    ),
    "the same image, another question, fresh engine (the image's rows cached)": (OTHER_QUESTION, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both columns")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--depth", type=int, default=VISION_0_8B["depth"], help="vision tower blocks")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "llmcli-bench-vision")
    args = parser.parse_args()

    loads = [load()]
    with clock() as built:
        folder = build_model(args.folder, args.depth)
    print(f"model in {folder} ({built():.0f} s to build or find)", file=sys.stderr)
    starts: dict[str, float] = {}
    with clock() as loading:
        ours = Llmcli(folder, args.dtype, args.threads)
    starts["llmcli: load"] = loading()
    with clock() as loading:
        theirs = Transformers(folder, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    starts["transformers: load"] = loading()
    torch.set_num_threads(args.threads)
    starts["llmcli: vision tower built (first image)"] = ours.build_tower()
    mine, reference = Column(), Column()
    seconds: dict[str, list[Phases]] = {name: [] for name in SECOND_REQUESTS}
    for run in range(args.runs + 1):  # run 0: the warm-up
        image = png(run)
        loads.append(load())
        engine = ours.engine()
        phases, token = ours.request(engine, image)
        for name, (question, same_engine) in SECOND_REQUESTS.items():
            again, token_again = ours.request(engine if same_engine else ours.engine(), image, question)
            assert question != QUESTION or token_again == token, "a cached prompt gave another token"
            seconds[name].append(again)
        theirs_phases, their_token = theirs.request(image)
        if args.dtype == "fp32" and token != their_token:
            print(
                f"run {run}: first tokens differ (llmcli {token}, transformers {their_token})",
                file=sys.stderr,
            )
        print(
            f"run {run}: llmcli {phases.total:.2f} s (tower {phases.tower:.2f}), then "
            + ", ".join(f"{values[-1].total:.2f}" for values in seconds.values())
            + f"; transformers {theirs_phases.total:.2f} s (tower {theirs_phases.tower:.2f})"
            + f"; load {load():.2f}",
            file=sys.stderr,
        )
        if run == 0:
            starts["llmcli: warm-up request"] = phases.total
            starts["transformers: warm-up request"] = theirs_phases.total
            for values in seconds.values():
                values.clear()
        else:
            mine.runs.append(phases)
            reference.runs.append(theirs_phases)
    loads.append(load())
    report(args, mine, reference, seconds, starts, loads)


def report(
    args: argparse.Namespace,
    mine: Column,
    reference: Column,
    seconds: dict[str, list[Phases]],
    starts: dict[str, float],
    loads: list[float],
) -> None:
    def row(name: str, pick: Callable[[Phases], float], scale: float = 1.0, digits: int = 2) -> str:
        values = [spread([pick(one) for one in column.runs], scale, digits) for column in (mine, reference)]
        return f"| {name} | {values[0]} | {values[1]} |"

    ratio = [one.total / other.total for one, other in zip(reference.runs, mine.runs, strict=True)]
    print(
        f"Qwen3.5-0.8B shape, random weights, {args.dtype}, vision depth {args.depth}, "
        f"one {SIDE}×{SIDE} image (784 image tokens), threads: {args.threads}, "
        f"{args.runs} runs after a warm-up; load average (1 min) {min(loads):.2f}–{max(loads):.2f}\n"
    )
    print("| seconds, median (lowest–highest) | llmcli (native decoder) | transformers (whole model) |")
    print("|---|---:|---:|")
    print(row("prepare (decode, processor, ids)", lambda one: one.prepare))
    print(row("vision tower (and merger)", lambda one: one.tower))
    print(row("decoder prefill to first token", lambda one: one.decoder))
    print(row("**time to first token**", lambda one: one.total))
    print(row("vision tower's share, %", lambda one: one.tower / one.total, 100, 0))
    print(f"| transformers / llmcli, time to first token | {spread(ratio)}× | |")
    print(
        f"\nllmcli, a second request with the image (the first prefilled {mine.runs[0].prefilled} tokens):\n"
    )
    print("| request | seconds to first token | tokens prefilled |\n|---|---:|---:|")
    for name, values in seconds.items():
        prefilled = ", ".join(str(count) for count in sorted({one.prefilled for one in values}))
        print(f"| {name} | {spread([one.total for one in values], digits=3)} | {prefilled} |")
    print("\n| once per process | seconds |\n|---|---:|")
    for name, value in starts.items():
        print(f"| {name} | {value:.2f} |")


if __name__ == "__main__":
    main()
