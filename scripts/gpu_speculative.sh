#!/usr/bin/env bash
# Issue 45, item 5 on a lent GPU: does speculation pay there now? In order of what is owed, each
# step with its own time limit and log under OUTDIR (a cut lease keeps what it measured):
#   kernel-tests  the kernels on CUDA tensors, the padded draft length, speculation's GPU tests
#   check-kernels µs per call of 1–16 rows per 8B layer: bf16, int8, int4 Triton, int4 tinygemm
#   spec-8b-int4  llmcli bench --speculative lookup, 8B int4 (llmcli's kernel): plain decode, the
#                 replayed copy-heavy stand-in (target ≥ 1.5×, same tokens), check cost per K
#   spec-8b-bf16  the same in bf16;  spec-8b-tinygemm  int4 through torch's kernel, to compare
#   spec-8b-int8  the same in int8
#   scripts/gpu_speculative.sh OUTDIR [STEP...]   (no step: all, about 8 minutes on an H100)
set -u
out=${1:-gpu-speculative}
shift
wanted=" ${*:-all} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    [[ $wanted == *" $name "* || $wanted == *" all "* ]] || return 0
    shift 2
    echo "== $name"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>"$out/$name.err"
    echo "   rc=$? in $((SECONDS - start)) s"
    tail -n 30 "$out/$name.txt"
    [ -s "$out/$name.err" ] && { echo "   stderr:"; tail -n 15 "$out/$name.err"; }
}

spec_8b() {  # spec_8b NAME SECONDS [extra args]
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 -m llmcli bench --config configs/llama-3.1-8b.json --random-weights \
        --device cuda --prompt-lengths 128 -n 128 --runs 3 --speculative lookup "$@"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
step kernel-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_speculative_schedule.py tests/test_gpu.py -k "quantized_kernels or int4 or int8 or pads or check_pass or speculat"
step check-kernels 120 python3 scripts/bench_check_kernels.py
spec_8b spec-8b-int4 150 --quant int4
spec_8b spec-8b-bf16 150
LLMCLI_INT4_CUDA=tinygemm spec_8b spec-8b-tinygemm 150 --quant int4
spec_8b spec-8b-int8 150 --quant int8
