#!/usr/bin/env bash
# The GPU figures docs/benchmarks.md owes, in one go: the GPU tests, then `llmcli bench` on
# random-weight Llama-3.2-1B and Llama-3.1-8B shapes (bf16, int8, int4). Each step has its own
# time limit and its own log, so one failure does not cost the rest.
#   scripts/gpu_figures.sh OUTDIR [tests|1b|8b|spec-1b|spec-8b|families|all]
#   (tests: the GPU tests and scripts/bench_kernels.py; spec-*: `llmcli bench --speculative`;
#   families: Gemma-3-4B, Phi-4-mini, gpt-oss-20b and Qwen3-30B-A3B shapes, bf16 — an MoE's
#   int8/int4 experts are refused on a GPU until a gathered kernel exists)
set -u
out=${1:-gpu-figures}
what=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
llmcli() { python3 -m llmcli "$@"; }

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>"$out/$name.err"
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s"
    tail -n 25 "$out/$name.txt"
    [ -s "$out/$name.err" ] && { echo "   stderr:"; tail -n 15 "$out/$name.err"; }
}

bench() {  # bench NAME SECONDS CONFIG [extra args]
    local name=$1 limit=$2 config=$3
    shift 3
    step "$name" "$limit" python3 -m llmcli bench --config "configs/$config.json" --random-weights \
        --device cuda --prompt-lengths 128 -n 128 --runs 5 "$@"
}

speculative() {  # speculative NAME SECONDS CONFIG [extra args]: check cost vs K, random text
    local name=$1 limit=$2 config=$3
    shift 3
    step "$name" "$limit" python3 -m llmcli bench --config "configs/$config.json" --random-weights \
        --device cuda --prompt-lengths 128 -n 128 --runs 3 "$@"
}

if [ "$what" = tests ] || [ "$what" = all ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt"
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >>"$out/gpu.txt"
    cat "$out/gpu.txt"
    step gpu-tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py
    step kernels 150 python3 scripts/bench_kernels.py
fi
if [ "$what" = 1b ] || [ "$what" = all ]; then
    bench 1b-bf16 180 llama-3.2-1b --context-fill 8192
    bench 1b-int4 90 llama-3.2-1b --quant int4 --no-generate --no-compiled
    bench 1b-int8 90 llama-3.2-1b --quant int8 --no-generate --no-compiled
fi
if [ "$what" = 8b ] || [ "$what" = all ]; then
    bench 8b-bf16 300 llama-3.1-8b --context-fill 8192
    bench 8b-int4 150 llama-3.1-8b --quant int4 --no-generate --no-compiled
    bench 8b-int8 150 llama-3.1-8b --quant int8 --no-generate --no-compiled
fi
if [ "$what" = families ] || [ "$what" = all ]; then
    bench gemma-3-4b 300 gemma-3-4b --context-fill 8192
    bench phi-4-mini 300 phi-4-mini
    bench gpt-oss-20b 420 gpt-oss-20b --no-compiled
    bench qwen3-30b-a3b 540 qwen3-30b-a3b --no-compiled --no-generate
    step families-cuda 300 python3 scripts/bench_families.py --device cuda --runs 3
fi
if [ "$what" = spec-1b ] || [ "$what" = all ]; then
    speculative spec-1b-bf16-lookup 150 llama-3.2-1b --speculative lookup
    speculative spec-1b-bf16-self 150 llama-3.2-1b --draft-model self
    speculative spec-1b-int4-lookup 150 llama-3.2-1b --quant int4 --speculative lookup
fi
if [ "$what" = spec-8b ] || [ "$what" = all ]; then
    speculative spec-8b-bf16-self 260 llama-3.1-8b --draft-model self
    speculative spec-8b-int4-lookup 170 llama-3.1-8b --quant int4 --speculative lookup
fi
