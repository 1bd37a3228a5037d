"""A GGUF model on this CPU: llmcli (as it loads the file by default, and dequantized) against
transformers' `model.generate` and, when llama-cpp-python is installed, llama.cpp itself.

All greedy, end-of-sequence ignored, the same prompt tokens, runs interleaved, median of --runs:
TTFT = a 1-token run; decode tok/s = (N − 1) / (T(N) − T(1)). llama-cpp-python is not a
dependency (it compiles llama.cpp, about 10 minutes): `pip install llama-cpp-python` to add it.

  python scripts/bench_gguf.py                       # the demo model
  python scripts/bench_gguf.py -m model.gguf --tokens 128 --runs 7
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from collections.abc import Callable

import torch

from llmcli.config.settings import LoadSettings
from llmcli.engine.bench import baseline, interleaved_medians, ours
from llmcli.engine.conversation import build_messages, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.models.load import load_model
from llmcli.models.resolve import demo_gguf_path, resolve_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def llama_cpp_run(path: str, prompt: list[int], threads: int) -> Callable[[int], Callable[[], object]]:
    from llama_cpp import Llama

    model = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)

    def make(new_tokens: int) -> Callable[[], object]:
        def run() -> object:
            model.reset()
            tokens = []
            for token in model.generate(prompt, temp=0.0, top_k=1, reset=True):
                tokens.append(token)
                if len(tokens) == new_tokens:
                    break
            return tokens

        return run

    return make


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="a .gguf file (default: the demo model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    path = args.model or str(demo_gguf_path())
    resolved = resolve_model(path)

    default = load_model(resolved, LoadSettings(device="cpu"))  # --quant auto
    plain = load_model(resolved, LoadSettings(device="cpu", quant="none"))
    ids = prompt_ids(default.tokenizer, build_messages(PROMPT))
    threads = torch.get_num_threads()
    makers: dict[str, Callable[[int], Callable[[], object]]] = {}
    for label, loaded in ((f"llmcli ({default.quant}, default)", default), ("llmcli (--quant none)", plain)):
        engine = Engine.for_loaded(dataclasses.replace(loaded, eos_token_ids=frozenset()))
        makers[label] = lambda n, engine=engine: ours(engine, ids, n)
    makers["transformers model.generate (fp32)"] = lambda n: baseline(plain.model, ids, n)
    if importlib.util.find_spec("llama_cpp") is not None:
        for n_threads in sorted({1, threads}):
            makers[f"llama.cpp ({n_threads} thread{'s' if n_threads > 1 else ''})"] = llama_cpp_run(
                path, ids, n_threads
            )
    medians = interleaved_medians(
        {f"{name}/{n}": make(n) for name, make in makers.items() for n in (1, args.tokens)},
        args.runs,
        torch.device("cpu"),
    )
    rates = {
        name: (args.tokens - 1) / (medians[f"{name}/{args.tokens}"] - medians[f"{name}/1"]) for name in makers
    }
    print(
        f"\n{resolved.name} · cpu · {threads} threads · prompt {len(ids)} tok · {args.tokens} new tokens · "
        f"greedy · median of {args.runs} runs\n"
    )
    print(f"| {'':38} | {'TTFT (ms)':>9} | {'decode tok/s':>12} |")
    print(f"|{'-' * 40}|{'-' * 11}|{'-' * 14}|")
    for name in makers:
        print(f"| {name:38} | {medians[f'{name}/1'] * 1000:9.1f} | {rates[name]:12.1f} |")
    ours_rate = rates[next(iter(makers))]
    print(
        f"\nllmcli default / model.generate: {ours_rate / rates['transformers model.generate (fp32)']:.2f}×"
    )
    for name in makers:
        if name.startswith("llama.cpp"):
            print(f"llmcli default / {name}: {ours_rate / rates[name]:.2f}×")
    if not any(name.startswith("llama.cpp") for name in makers):
        print("(llama.cpp column skipped: pip install llama-cpp-python to add it)")


if __name__ == "__main__":
    main()
