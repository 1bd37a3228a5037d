#!/usr/bin/env bash
# The GPU figures docs/benchmarks.md owes, in one go: the GPU tests, then `llmcli bench` on
# random-weight Llama-3.2-1B and Llama-3.1-8B shapes (bf16, int8, int4). Each step has its own
# time limit and its own log, so one failure does not cost the rest.
#   scripts/gpu_figures.sh OUTDIR [STEP...]   (no step: all)
#   STEP: a group — tests (the GPU tests, then kernels), 1b, 8b, spec-1b, spec-8b, families
#   (Gemma-3-4B, Phi-4-mini, gpt-oss-20b and Qwen3-30B-A3B shapes in bf16 — an MoE's int8/int4
#   experts are refused on a GPU until a gathered kernel exists; then bench_families on cuda) —
#   or one step of a group by its name (gpu-tests, kernels, gemma-3-4b, families-cuda, …), so
#   a short lease can spend its minutes where they are owed. RUNS=3 shortens each bench.
set -u
out=${1:-gpu-figures}
shift
wanted=" ${*:-all} "
runs=${RUNS:-5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
llmcli() { python3 -m llmcli "$@"; }

wants() {  # wants NAME GROUP: whether the step NAME (of GROUP) was asked for
    [[ $wanted == *" $1 "* || $wanted == *" $2 "* || $wanted == *" all "* ]]
}

step() {  # step NAME GROUP SECONDS COMMAND...
    local name=$1 limit=$3
    wants "$name" "$2" || return 0
    shift 3
    echo "== $name"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>"$out/$name.err"
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s"
    tail -n 25 "$out/$name.txt"
    [ -s "$out/$name.err" ] && { echo "   stderr:"; tail -n 15 "$out/$name.err"; }
}

bench() {  # bench NAME GROUP SECONDS CONFIG [extra args]
    local name=$1 group=$2 limit=$3 config=$4
    shift 4
    step "$name" "$group" "$limit" python3 -m llmcli bench --config "configs/$config.json" \
        --random-weights --device cuda --prompt-lengths 128 -n 128 --runs "$runs" "$@"
}

speculative() {  # speculative NAME GROUP SECONDS CONFIG [extra args]: check cost vs K, random text
    local name=$1 group=$2 limit=$3 config=$4
    shift 4
    step "$name" "$group" "$limit" python3 -m llmcli bench --config "configs/$config.json" \
        --random-weights --device cuda --prompt-lengths 128 -n 128 --runs 3 "$@"
}

if wants gpu-tests tests; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt"
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >>"$out/gpu.txt"
    cat "$out/gpu.txt"
fi
step gpu-tests tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_quant.py
step kernels tests 150 python3 scripts/bench_kernels.py
bench 1b-bf16 1b 180 llama-3.2-1b --context-fill 8192
bench 1b-int4 1b 90 llama-3.2-1b --quant int4 --no-generate --no-compiled
bench 1b-int8 1b 90 llama-3.2-1b --quant int8 --no-generate --no-compiled
bench 8b-bf16 8b 300 llama-3.1-8b --context-fill 8192
bench 8b-int4 8b 150 llama-3.1-8b --quant int4 --no-generate --no-compiled
bench 8b-int8 8b 150 llama-3.1-8b --quant int8 --no-generate --no-compiled
bench gemma-3-4b families 300 gemma-3-4b --context-fill 8192
bench phi-4-mini families 300 phi-4-mini
bench gpt-oss-20b families 420 gpt-oss-20b --no-compiled
bench qwen3-30b-a3b families 540 qwen3-30b-a3b --no-compiled --no-generate
step families-cuda families 300 python3 scripts/bench_families.py --device cuda --runs 3
speculative spec-1b-bf16-lookup spec-1b 150 llama-3.2-1b --speculative lookup
speculative spec-1b-bf16-self spec-1b 150 llama-3.2-1b --draft-model self
speculative spec-1b-int4-lookup spec-1b 150 llama-3.2-1b --quant int4 --speculative lookup
speculative spec-8b-bf16-self spec-8b 260 llama-3.1-8b --draft-model self
speculative spec-8b-int4-lookup spec-8b 170 llama-3.1-8b --quant int4 --speculative lookup
