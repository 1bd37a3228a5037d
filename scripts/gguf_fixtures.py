"""llmcli on llama.cpp's GGUF fixtures (../shared/gguf-fixtures): per file, how llmcli loads it
(its engine, the dtype and quantization its weights are held in, their bytes beside the file's),
and its logits on the fixture's text beside llama.cpp's own on the same file: the KL divergence
KL(llama.cpp || llmcli) per position (mean, nats), the share of positions whose top token agrees,
and the perplexity of the text under each (as the fixtures' manifest defines it).

    python scripts/gguf_fixtures.py [--fixtures ../shared/gguf-fixtures] [--only Q4_K_M,F16]

Each file loads through llmcli's default path (the first load converts it into llmcli's cache;
the script uses a cache folder of its own, so its conversions are not left in yours).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from llama_cpp_reference import kl_and_top1, perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "shared" / "gguf-fixtures"
    parser.add_argument("--fixtures", type=Path, default=default)
    parser.add_argument("--only", help="types to run, comma-separated (default: every file)")
    args = parser.parse_args()
    manifest = json.loads((args.fixtures / "manifest.json").read_text())
    wanted = set(args.only.split(",")) if args.only else None
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="llmcli-gguf-fixtures-")

    from llmcli.config.settings import LoadSettings
    from llmcli.engine.loop import Engine
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    columns = "type | engine | held as | held / file | KL (nats) | top-1 | ppl | llama.cpp ppl | Δ ppl"
    print(f"| {columns} |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, entry in manifest["files"].items():
        if wanted is not None and entry["type"] not in wanted:
            continue
        path = args.fixtures / name
        reference = np.load(args.fixtures / entry["reference"])
        ids = reference["ids"]
        loaded = load_model(resolve_model(str(path)), LoadSettings(device="cpu"), lean=True)  # as `generate`
        engine = Engine.for_loaded(loaded)
        with torch.inference_mode():
            logits = engine.backend.score([int(i) for i in ids]).float()
        kl, top = kl_and_top1(reference["logits"], logits)
        ours, theirs = perplexity(logits, ids), perplexity(torch.from_numpy(reference["logits"]), ids)
        held = loaded.weight_bytes / entry["size_bytes"]
        print(
            f"| {entry['type']} | {engine.name} | {loaded.dtype_name} {loaded.quant} | {held:.2f}× | "
            f"{kl:.5f} | {top:.3f} | {ours:,.0f} | {theirs:,.0f} | {100 * (ours / theirs - 1):+.2f} % |"
        )


if __name__ == "__main__":
    main()
