"""`llmcli bench`: prefill, TTFT, decode and memory, against transformers in the same run.

Decode at batch 1 reads every weight once per token (but one row of the input embedding, and
of a sparse MoE only the experts it is routed to), so its floor is those bytes ÷ memory
bandwidth. We measure that bandwidth on the spot (a large device-to-device copy) and report how
close decoding comes to it: achieved GB/s = (those weight bytes + KV bytes read) × tokens/s.
Beside it, the practical ceiling of these very weights on this device: every linear layer of the model as
one matrix-vector product, the whole set in one CUDA graph (eager on a CPU) — no batch-1 decode
of these weights can beat it. The baselines: eager `model.generate`, and on CUDA transformers'
own compiled path (`generate(cache_implementation="static")`, which compiles itself).
Every figure is the median of several runs after a warm-up; the contenders' runs are
interleaved so drift in machine speed hits them alike.
"""

from __future__ import annotations

import functools
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.loop import Engine
from llmcli.models.cpu_kernels import which_on
from llmcli.models.load import LoadedModel


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    quant: str
    cpu_kernels: str | None  # what multiplies a GGUF file's blocks on the CPU (None elsewhere)
    engine: str  # the backend that ran llmcli's loop: native or transformers
    graphs: bool  # decode replayed as CUDA graphs
    weight_bytes: int
    kv_bytes_per_token: int
    runs: int
    new_tokens: int
    bandwidth_gb_s: float  # measured now, device to device
    prefill_tok_s: dict[int, float] = field(default_factory=dict)  # prompt length → tok/s
    ttft_s: float = 0.0
    decode_tok_s: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    achieved_gb_s: float = 0.0
    roofline_pct: float = 0.0
    peak_memory_bytes: int = 0
    context_fill: int | None = None  # tokens already cached for the decode_at_fill figure
    decode_tok_s_at_fill: float | None = None
    generate_ttft_s: float | None = None
    generate_decode_tok_s: float | None = None
    generate_achieved_gb_s: float | None = None
    speedup_vs_generate: float | None = None
    compiled_decode_tok_s: float | None = None  # transformers' compiled static-cache generate
    # The weights as transformers' model holds them (loaded for model.generate): more than
    # `generate` holds where its lean load shares what transformers keeps twice (a tied
    # embedding table beside the quantized output layer).
    transformers_model: bool = False
    speedup_vs_compiled: float | None = None
    ceiling_tok_s: float | None = None  # the linear layers alone, one GEMV each, one graph
    ceiling_pct: float | None = None
    ceiling_bytes: int | None = None  # the weight bytes the ceiling's pass reads
    ceiling_left_out: list[str] = field(default_factory=list)  # layers of a kind it cannot time
    # Each figure's lowest and highest run, beside its median: "ttft_s", "decode_tok_s",
    # "generate_decode_tok_s", "prefill_tok_s@512", …
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["prefill_tok_s"] = {str(k): v for k, v in self.prefill_tok_s.items()}
        return record


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_times(
    fns: dict[str, Callable[[], object]], runs: int, device: torch.device
) -> dict[str, list[float]]:
    """Wall times of each function over `runs`, the runs interleaved, after one warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def interleaved_medians(
    fns: dict[str, Callable[[], object]], runs: int, device: torch.device
) -> dict[str, float]:
    """Median wall time of each function over `runs`, the runs interleaved, after one warm-up."""
    return {name: statistics.median(values) for name, values in interleaved_times(fns, runs, device).items()}


def low_high(values: list[float]) -> tuple[float, float]:
    return (min(values), max(values))


def measure_bandwidth(device: torch.device, size_bytes: int | None = None, repeats: int = 5) -> float:
    """Device memory bandwidth in GB/s: a large copy reads and writes every byte once."""
    size = size_bytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: page in both buffers
    seconds = statistics.median(timed(lambda: target.copy_(source), device) for _ in range(repeats))
    return 2 * size / seconds / 1e9


def ours(engine: Engine, prompt: list[int], new_tokens: int) -> Callable[[], Any]:
    """One generation of exactly `new_tokens` tokens (end-of-sequence ignored) from an empty cache."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

    def run() -> Any:
        engine.reset()
        return engine.complete(prompt, params)

    return run


def baseline(model: Any, prompt: list[int], new_tokens: int, **options: Any) -> Callable[[], Any]:
    """`model.generate`, greedy, exactly `new_tokens` tokens; `options` such as
    cache_implementation="static" select transformers' compiled path."""
    input_ids = torch.tensor([prompt], device=model.device)
    attention_mask = torch.ones_like(input_ids)

    def run() -> Any:
        with torch.inference_mode():
            return model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
                **options,
            )

    return run


def expert_modules(model: Any) -> list[torch.nn.Module]:
    """A sparse MoE's stacked-expert modules (transformers' `…Experts`), each of whose experts a
    decode step reads only when the router chooses it."""
    return [module for module in model.modules() if type(module).__name__.endswith("Experts")]


def experts_read_per_token(model: Any) -> tuple[int, int] | None:
    """(k, experts): how many of a sparse layer's experts one token reads, or None (dense)."""
    config = model.config.get_text_config()
    chosen = getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return (chosen, experts) if chosen and experts and expert_modules(model) else None


def weight_bytes_read(model: Any, weight_bytes: int) -> float:
    """Weight bytes a batch-1 decode step reads: all of them but the input embedding's other rows
    (one row is looked up, unless the output head shares the table and reads it whole), and of a
    sparse MoE's experts the k a token is routed to (counting every expert made its achieved
    bandwidth exceed the device's)."""
    read = float(weight_bytes)
    # A lean GGUF load's tied table is the int8 head's own rows (HeadRows, no weight of its
    # own): the head reads it whole, nothing to take off.
    embedding = getattr(model.get_input_embeddings(), "weight", None)
    head = model.get_output_embeddings()
    if embedding is not None and getattr(head, "weight", None) is not embedding:  # an int8 head: codes
        read -= embedding.numel() * embedding.element_size() * (1 - 1 / embedding.shape[0])
    sparse = experts_read_per_token(model)
    if sparse is None:
        return read
    chosen, experts = sparse
    stored = sum(
        tensor.numel() * tensor.element_size()
        for module in expert_modules(model)
        for tensor in (*module.parameters(), *module.buffers())
    )
    return read - stored * (1 - chosen / experts)


@dataclass
class CeilingLayers:
    """What the ceiling multiplies: each linear layer as a call on a one-row input of its width,
    the bytes those calls read, and the linear-looking layers of a kind it has no call for (named
    in the report, never silently left out)."""

    calls: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    bytes: int = 0
    left_out: list[str] = field(default_factory=list)

    def add(
        self, call: Callable[[torch.Tensor], torch.Tensor], width: int, tensors: list[torch.Tensor]
    ) -> None:
        self.calls.append(call)
        self.widths.append(width)
        self.bytes += sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


def held_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def ceiling_layers(model: Any) -> CeilingLayers:
    """Every linear layer of the model, whatever holds its weights: dense ones as bare matrix
    products, llmcli's quantized ones (int8/int4 codes) and a GGUF file's layers kept in their
    blocks (block_linear.py: the compiled CPU kernels, gguf_cuda's on a GPU) through their own
    forward. A sparse MoE's layers count k experts each, the first k (a token reads k,
    whichever they are). A slice of a fused layer is its whole's, counted once."""
    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.quantized import QuantizedLinear, QuantizedSlice

    layers = CeilingLayers()
    sparse = experts_read_per_token(model)
    inside_experts: set[int] = set()
    chosen = sparse[0] if sparse else 0
    for module in expert_modules(model) if sparse else ():
        inside_experts |= {id(inner) for inner in module.modules()}
        stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.numel()]
        for weight in stacked:  # [experts, a, b] in either layout: a GEMV reads all of a slice
            for expert in range(chosen):
                call = functools.partial(torch.nn.functional.linear, weight=weight[expert])
                layers.add(call, weight.shape[-1], [weight[expert]])
        for group in (m for m in module.children() if isinstance(m, torch.nn.ModuleList)):
            for layer in list(group)[:chosen]:  # --quant's experts: one layer each
                layers.add(layer.forward, layer.in_features, held_tensors(layer))
    for name, module in model.named_modules():
        if id(module) in inside_experts or isinstance(module, QuantizedSlice):
            continue
        if isinstance(module, torch.nn.Linear):
            call = functools.partial(torch.nn.functional.linear, weight=module.weight)
            layers.add(call, module.in_features, [module.weight])
        elif isinstance(module, (QuantizedLinear, BlockLinear)):
            layers.add(module.forward, module.in_features, held_tensors(module))
        elif hasattr(module, "in_features") and hasattr(module, "out_features"):
            layers.left_out.append(f"{name} ({type(module).__name__})")
    return layers


def linear_ceiling(model: Any, runs: int) -> tuple[float, CeilingLayers]:
    """Seconds for one pass over every linear layer's weights as matrix-vector products: what
    a batch-1 decode step of these weights costs when nothing else runs. One CUDA graph on CUDA
    (no launch gaps), plain calls elsewhere. Beside it, the layers it timed (ceiling_layers)."""
    device, dtype = model.device, model.dtype
    layers = ceiling_layers(model)
    inputs = [torch.randn(1, width, dtype=dtype, device=device) for width in layers.widths]

    def one_pass() -> None:
        for x, layer in zip(inputs, layers.calls, strict=True):
            layer(x)

    with torch.inference_mode():
        step: Callable[[], object] = one_pass
        if device.type == "cuda":
            one_pass()  # warm-up: cuBLAS picks its kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_pass()
            step = graph.replay
        return interleaved_medians({"ceiling": step}, max(runs, 5), device)["ceiling"], layers


def prompt_of(length: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def run_bench(
    loaded: LoadedModel,
    *,
    prompt_lengths: list[int],
    new_tokens: int,
    runs: int,
    with_generate: bool = True,
    with_compiled: bool | None = None,
    context_fill: int | None = None,
    engine: Engine | None = None,
) -> BenchReport:
    """`with_compiled` (default: on CUDA) adds transformers' compiled path; `context_fill` times
    decode with that many tokens already in the cache."""
    device = loaded.device
    vocab = loaded.model.config.get_text_config().vocab_size
    # End-of-sequence off: every run produces exactly the tokens asked for.
    engine = engine or Engine.for_loaded(loaded)
    engine.eos_token_ids = frozenset()
    lengths = [n for n in prompt_lengths if n + new_tokens <= loaded.context_length] or [16]
    report = BenchReport(
        model=loaded.name,
        device=str(device),
        dtype=loaded.dtype_name,
        quant=loaded.quant,
        cpu_kernels=which_on(device, loaded.quant),
        engine=engine.name,
        graphs=engine.backend.captures_graphs,
        weight_bytes=loaded.weight_bytes,
        kv_bytes_per_token=loaded.kv_bytes_per_token,
        runs=runs,
        transformers_model=not type(loaded.model).__module__.startswith("llmcli."),
        new_tokens=new_tokens,
        bandwidth_gb_s=measure_bandwidth(device),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report.prefill_tok_s = _prefill_rates(engine, lengths, vocab, runs, device, report.spread)
    prompt = prompt_of(lengths[0], vocab)
    compiled = with_compiled if with_compiled is not None else device.type == "cuda"
    contenders = _contenders(loaded, engine, prompt, new_tokens, with_generate, compiled)
    if context_fill and context_fill + new_tokens <= loaded.context_length:
        filled = prompt_of(context_fill, vocab)
        contenders |= {"fill/1": ours(engine, filled, 1), "fill/n": ours(engine, filled, new_tokens)}
        report.context_fill = context_fill
    times = interleaved_times(contenders, runs, device)
    medians = {name: statistics.median(values) for name, values in times.items()}
    _fill_decode_figures(report, times, [ours(engine, prompt, new_tokens)() for _ in range(runs)])
    kv_read = loaded.kv_bytes_per_token * (lengths[0] + new_tokens / 2)
    bytes_per_token = weight_bytes_read(loaded.model, loaded.weight_bytes) + kv_read
    report.achieved_gb_s = bytes_per_token * report.decode_tok_s / 1e9
    report.roofline_pct = 100 * report.achieved_gb_s / report.bandwidth_gb_s
    if with_generate:
        report.generate_ttft_s = medians["generate/1"]
        report.spread["generate_ttft_s"] = low_high(times["generate/1"])
        report.generate_achieved_gb_s = bytes_per_token * report.generate_decode_tok_s / 1e9
        report.speedup_vs_generate = report.decode_tok_s / report.generate_decode_tok_s
    if report.compiled_decode_tok_s:
        report.speedup_vs_compiled = report.decode_tok_s / report.compiled_decode_tok_s
    seconds, layers = linear_ceiling(loaded.model, runs)
    report.ceiling_tok_s = 1 / seconds
    report.ceiling_bytes, report.ceiling_left_out = layers.bytes, layers.left_out
    report.ceiling_pct = 100 * report.decode_tok_s / report.ceiling_tok_s
    report.peak_memory_bytes = peak_memory(device)
    return report


def _prefill_rates(
    engine: Engine,
    lengths: list[int],
    vocab: int,
    runs: int,
    device: torch.device,
    spread: dict[str, tuple[float, float]],
) -> dict[int, float]:
    """Prompt tokens per second at each length, from an empty cache (and each one's spread)."""
    rates = {}
    for length in lengths:
        prompt = prompt_of(length, vocab)

        def prefill(prompt: list[int] = prompt) -> None:
            engine.reset()
            engine.prefill(prompt)

        seconds = interleaved_times({"prefill": prefill}, runs, device)["prefill"]
        rates[length] = length / statistics.median(seconds)
        spread[f"prefill_tok_s@{length}"] = low_high([length / s for s in seconds])
    return rates


def _contenders(
    loaded: LoadedModel, engine: Engine, prompt: list[int], new_tokens: int, generate: bool, compiled: bool
) -> dict[str, Callable[[], Any]]:
    """Each contender twice, for 1 and for `new_tokens` tokens: decode speed is the difference."""
    contenders = {"ours/1": ours(engine, prompt, 1), "ours/n": ours(engine, prompt, new_tokens)}
    if generate:
        contenders |= {
            "generate/1": baseline(loaded.model, prompt, 1),
            "generate/n": baseline(loaded.model, prompt, new_tokens),
        }
    if compiled:
        static = {"cache_implementation": "static"}
        contenders |= {
            "compiled/1": baseline(loaded.model, prompt, 1, **static),
            "compiled/n": baseline(loaded.model, prompt, new_tokens, **static),
        }
    return contenders


def _fill_decode_figures(report: BenchReport, times: dict[str, list[float]], results: list[Any]) -> None:
    """Decode rates from the interleaved runs (the median's, and each run pair's for the
    spread); TTFT and inter-token latency from `results`."""
    new_tokens = report.new_tokens

    def decode_rate(name: str, figure: str) -> float | None:
        if f"{name}/n" not in times:
            return None
        longer, shorter = times[f"{name}/n"], times[f"{name}/1"]
        pairs = [(new_tokens - 1) / (n - one) for n, one in zip(longer, shorter, strict=True) if n > one]
        if pairs:  # a run pair the machine's load reversed says nothing of the rate
            report.spread[figure] = low_high(pairs)
        difference = statistics.median(longer) - statistics.median(shorter)
        return (new_tokens - 1) / difference if difference > 0 else None  # load hid the decode

    gaps = sorted(gap for result in results for gap in result.stats.inter_token_s)
    ttfts = [result.stats.ttft_s for result in results]
    report.ttft_s = statistics.median(ttfts)
    report.spread["ttft_s"] = low_high(ttfts)
    report.decode_tok_s = decode_rate("ours", "decode_tok_s") or 0.0
    report.decode_tok_s_at_fill = decode_rate("fill", "decode_tok_s_at_fill")
    report.generate_decode_tok_s = decode_rate("generate", "generate_decode_tok_s")
    report.compiled_decode_tok_s = decode_rate("compiled", "compiled_decode_tok_s")
    report.itl_p50_ms = 1000 * gaps[len(gaps) // 2] if gaps else 0.0
    report.itl_p99_ms = 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] if gaps else 0.0


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
