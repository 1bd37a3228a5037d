"""Where a native decode step's GPU time goes, for one config with random weights.

    python scripts/profile_decode.py --config configs/gemma-3-4b.json [--steps 16] [--top 15]

Prints the graph-replayed step's GPU time (CUDA events, median of the steps), then the same
bucketed step run eagerly under torch's profiler: its kernels by total GPU time. Where the
graphed step is far above the linear layers' ceiling (`llmcli bench`), this says which
kernels hold the difference.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from llmcli.config.settings import LoadSettings
from llmcli.engine.native.backend import NativeBackend
from llmcli.models.load import load_random


def graphed_step_ms(backend: NativeBackend, token: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backend.decode(token)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    loaded = load_random(args.config, LoadSettings(device="cuda", quant="none"))
    vocab = loaded.model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,)).tolist()
    token = torch.tensor([1], device="cuda")
    for graphs in (True, False):
        backend = NativeBackend(loaded.model, 4096, graphs=graphs, static_shapes=True)
        backend.prefill(prompt)
        graphed_step_ms(backend, token, 4)  # capture, warm-up
        if graphs:
            times = graphed_step_ms(backend, token, args.steps)
            spread = f"min {min(times):.3f}, max {max(times):.3f}"
            print(f"graphed step: {statistics.median(times):.3f} ms ({spread})")
        else:
            times = graphed_step_ms(backend, token, args.steps)
            print(f"eager bucketed step: {statistics.median(times):.3f} ms")
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profile:
                graphed_step_ms(backend, token, args.steps)
            table = profile.key_averages().table(
                sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=70
            )
            print(f"eager bucketed step, {args.steps} steps, kernels by GPU time:\n{table}")
        del backend
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
