#!/usr/bin/env bash
# The GPU figures docs/benchmarks.md owes. By default ("lease") one run that fits a lent GPU's
# lease: every GPU target of issue 45 measured in ≤ 8 minutes on an H100/H200, each step written
# to OUTDIR as it runs (a cut lease keeps what it measured), ending with ONE table — target,
# measured, ratio, met? — with the card named (scripts/gpu_table.py, also OUTDIR/table.md,
# rewritten after every step). The longer steps of earlier issues stay selectable by name.
#   scripts/gpu_figures.sh OUTDIR [STEP...]   (no step: lease)
#   STEP: a group — lease, tests (the GPU tests, then kernels), 1b, 8b, spec-1b, spec-8b, families
#   (Gemma-3-4B, Phi-4-mini, gpt-oss-20b and Qwen3-30B-A3B shapes in bf16; then bench_families on
#   cuda), all (every step: more than an hour) — or one step by its name (ceiling-8b-bf16,
#   streams-1b, gpu-tests, gemma-3-4b, families-cuda, …).
# On a lent machine, from the repository root (OUTDIR off $OUT: only 8 files come back), with the
# gguf wheel carried in .whl (below), timeout_s 540:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site; FIGURES_ARCHIVE=$OUT/figures.tgz scripts/gpu_figures.sh \
#   /tmp/figures 2>&1 | tee $OUT/log.txt
#
# The lease's budget in seconds on an H100. The decoding is docs/benchmarks.md's H100 figures (8B
# bf16 7.4 ms a token, int4 4.1 ms, 1B bf16 1.9 ms, graph capture 1–2 s, checks of K tokens
# 1.1× a step); the starts (imports ~5 s, random 8B weights built on the GPU ~15 s, int4
# quantizing ~20 s, 16 GB saved ~30 s) are guesses no GPU has checked yet: each step's NAME.rc
# gives its real seconds. The limit is each step's own, and no step runs past FIGURES_SECONDS
# (480 by default for the lease) less the 100 kept for the pytest step at the end:
#   step               what it gives                                    estimate  limit
#   card               the card, torch, driver                                 5     30
#   ceiling-8b-bf16    8B bf16 batch-1 decode ÷ its linear-layers ceiling     40     90
#   ceiling-1b-bf16    1B bf16 decode ÷ its ceiling                           20     60
#   ceiling-8b-int4    8B int4 decode ÷ its ceiling (quantizing ~20 s)        50     90
#   streams-1b         1B, 8 streams ÷ one; one ÷ ceiling-1b-bf16's decode    30     75
#   streams-8b         8B, 16 streams ÷ one; one ÷ ceiling-8b-bf16's decode   45    100
#   kquant-gemv        K-quant GEMVs on 8B shapes ÷ copy bandwidth            10     45
#   kquant-decode      a Q4_K_M file's decode ÷ ceiling-8b-int4's decode      60    120
#   spec-8b-lookup     lookup ÷ plain decode, 8B bf16, same tokens            40     90
#   first-token-1b     one-shot `generate`, page cache: first byte, breakdown 25     60
#   first-token-8b     the same for 8B (16 GB written to FIGURES_SCRATCH)     70    120
#   gpu-tests          new GPU and kernel tests first, then -m gpu's rest     90    100
#   total                                       ~485 s: the last steps are cut to fit 480 s
# kquant-decode writes a Q4_K_M file of the 8B's shapes, random blocks (scripts/random_gguf.py,
# 4.6 GB in FIGURES_SCRATCH), or takes FIGURES_GGUF. It needs the gguf package, which the GPU
# image lacks: carry its wheel (118 kB, pure Python; its needs numpy, pyyaml, requests and tqdm
# are there): `echo /.whl/ >>.git/info/exclude; pip download --no-deps --only-binary=:all: -d
# .whl gguf==0.19.0`. Without it the row says so (llmcli needs gguf to read any GGUF file, and
# test files that import it do not collect: their tests are named apart in the pytest row).
#
# Environment: PYTHON (python3), RUNS (5: the long steps), LEASE_RUNS (3), FIGURES_TOKENS (128
# new tokens), FIGURES_DEVICE (cuda), FIGURES_1B / FIGURES_8B (the configs), FIGURES_SECONDS,
# FIGURES_SCRATCH (folders of saved weights), FIGURES_TESTS (pytest's paths), FIGURES_ARCHIVE (a
# .tgz of OUTDIR, rewritten after every step), FIGURES_KQUANT_TYPES and _SHAPES, FIGURES_GGUF.
# A dry run on a CPU with a tiny config (what tests/test_gpu_figures.py does):
#   FIGURES_DEVICE=cpu FIGURES_1B=tiny.json FIGURES_8B=tiny.json scripts/gpu_figures.sh OUT lease
set -u
out=$(realpath -m "${1:-gpu-figures}")
shift
wanted=" ${*:-lease} "
# Paths given relative to where the script was called from, the defaults relative to the checkout.
[[ -n ${FIGURES_1B:-} ]] && FIGURES_1B=$(realpath -m "$FIGURES_1B")
[[ -n ${FIGURES_8B:-} ]] && FIGURES_8B=$(realpath -m "$FIGURES_8B")
[[ -n ${FIGURES_GGUF:-} ]] && FIGURES_GGUF=$(realpath -m "$FIGURES_GGUF")
cd "$(dirname "$0")/.." || exit 1
py=${PYTHON:-python3}
runs=${RUNS:-5}
lease_runs=${LEASE_RUNS:-3}
tokens=${FIGURES_TOKENS:-128}
device=${FIGURES_DEVICE:-cuda}
small=${FIGURES_1B:-configs/llama-3.2-1b.json}
large=${FIGURES_8B:-configs/llama-3.1-8b.json}
scratch=${FIGURES_SCRATCH:-${TMPDIR:-/tmp}/llmcli-figures}
archive=${FIGURES_ARCHIVE:-}
if [[ -n ${FIGURES_SECONDS:-} ]]; then
    budget=$FIGURES_SECONDS
elif [[ $wanted == " lease " ]]; then
    budget=480
else
    budget=0 # no budget: each step's own limit alone
fi
tests_reserve=100 # kept for the pytest step, which runs last
mkdir -p "$out" "$scratch"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
printf 'device %s · 1B %s · 8B %s · %s new tokens · budget %s s\n' \
    "$device" "$small" "$large" "$tokens" "$budget" >"$out/run.txt"

wants() { # wants NAME GROUP: whether the step NAME (of GROUP) was asked for
    [[ $wanted == *" $1 "* || $wanted == *" $2 "* || $wanted == *" all "* ]]
}

summarize() { # the one table so far, and the archive a cut lease keeps
    "$py" scripts/gpu_table.py "$out" >"$out/table.md" 2>>"$out/table.err"
    [[ -n $archive ]] && tar -czf "$archive.part" -C "$out" . && mv "$archive.part" "$archive"
    return 0
}

allowed() { # allowed LIMIT RESERVE: LIMIT cut to what the budget leaves beyond RESERVE seconds
    local limit=$1 reserve=$2
    ((budget > 0)) || { echo "$limit"; return; }
    local left=$((budget - SECONDS - reserve - 10)) # 10: timeout's grace before it kills
    echo $((left < limit ? left : limit))
}

step() { # step NAME GROUP SECONDS COMMAND...: stdout to NAME.out, stderr to NAME.err, "rc s limit" to NAME.rc
    local name=$1 group=$2
    wants "$name" "$group" || return 0
    local reserve=0
    if [[ $group == lease && $name != gpu-tests ]] && ((budget > 0)) && wants gpu-tests lease; then
        reserve=$tests_reserve
    fi
    local limit
    limit=$(allowed "$3" "$reserve")
    shift 3
    echo "== $name"
    if ((limit < 5)); then
        echo "skipped 0 $limit" >"$out/$name.rc"
        echo "   skipped: the budget of $budget s is spent"
        summarize
        return 0
    fi
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err" # then killed, if it lingers
    local rc=$?
    echo "$rc $((SECONDS - start)) $limit" >"$out/$name.rc"
    echo "   rc=$rc in $((SECONDS - start)) s (limit $limit)"
    tail -n 3 "$out/$name.out" | cut -c1-240
    [ -s "$out/$name.err" ] && { echo "   stderr:"; tail -n 3 "$out/$name.err" | cut -c1-240; }
    summarize
}

bench() { # bench NAME GROUP SECONDS CONFIG [extra args]: the long steps' table
    local name=$1 group=$2 limit=$3 config=$4
    shift 4
    step "$name" "$group" "$limit" "$py" -m llmcli bench --config "configs/$config.json" \
        --random-weights --device "$device" --prompt-lengths 128 -n 128 --runs "$runs" "$@"
}

speculative() { # speculative NAME GROUP SECONDS CONFIG [extra args]: check cost vs K, random text
    local name=$1 group=$2 limit=$3 config=$4
    shift 4
    step "$name" "$group" "$limit" "$py" -m llmcli bench --config "configs/$config.json" \
        --random-weights --device "$device" --prompt-lengths 128 -n 128 --runs 3 "$@"
}

measure() { # measure NAME SECONDS CONFIG [extra args]: one lease step of `llmcli bench --json`
    local name=$1 limit=$2 config=$3
    shift 3
    step "$name" lease "$limit" "$py" -m llmcli bench --config "$config" --random-weights \
        --device "$device" --prompt-lengths 128 -n "$tokens" --runs "$lease_runs" --json "$@"
}

# The streams rows' command: `llmcli bench --concurrency 1,N` over the KV layout a GPU server
# takes by default (`serve --kv-layout paged`: one paged pool, a CUDA graph per batch size);
# gpu_table.py reads its --json (levels: sequences, aggregate_tok_s, versus_one).
streams() { # streams NAME SECONDS CONFIG SEQUENCES
    measure "$1" "$2" "$3" --concurrency "1,$4" --kv-layout paged
}

card() { # the card the table names
    "$py" - "$device" <<'EOF'
import json, platform, subprocess, sys
import torch
device = sys.argv[1]
record = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda}
if device.startswith("cuda") and torch.cuda.is_available():
    props = torch.cuda.get_device_properties(torch.device(device))
    record |= {"card": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    record["driver"] = smi.stdout.strip() or None
else:
    record["card"] = f"CPU ({platform.processor() or platform.machine()}), no GPU"
print(json.dumps(record))
EOF
}

kquant_decode() { # a Q4_K_M file of the 8B's shapes (FIGURES_GGUF, else random blocks), benched
    local file=${FIGURES_GGUF:-$scratch/random-q4_k_m.gguf}
    if [[ -z ${FIGURES_GGUF:-} ]]; then
        "$py" scripts/random_gguf.py --config "$large" --out "$file"
        local made=$?
        ((made == 3)) && return 0 # no gguf package: its JSON says so
        ((made == 0)) || return $made
    fi
    "$py" -m llmcli bench -m "$file" --device "$device" --prompt-lengths 128 -n "$tokens" \
        --runs "$lease_runs" --no-generate --no-compiled --json
    local rc=$?
    [[ -z ${FIGURES_GGUF:-} ]] && rm -f "$file"
    return $rc
}

# The tests no GPU has run yet come first, so a cut at the time box loses the least news: the new
# GPU-marked tests, then the kernel tests (unmarked: under Triton's interpreter on a CPU, compiled
# on the card here), then the GPU-marked rest, test_gpu.py and test_quant.py (run on an H100
# before) first. FIGURES_TESTS names other paths: `pytest -m gpu` on them alone.
new_gpu_tests="tests/test_gpu_batched.py tests/test_gpu_gguf.py tests/test_gpu_paged_serve.py
    tests/test_paged_cuda.py tests/test_paged_kvcache.py tests/test_speculative_schedule.py"
kernel_tests="tests/test_gguf_cuda.py tests/test_triton_kernels.py tests/test_paged_cuda.py
    tests/test_paged_kvcache.py"
gpu_tests() { # the gpu-tests step: pytest's -v lines, one run after another, into one output
    local pytest=("$py" -m pytest -v -rfE -p no:cacheprovider --continue-on-collection-errors)
    if [[ -n ${FIGURES_TESTS:-} ]]; then
        "${pytest[@]}" -m gpu $FIGURES_TESTS
        return
    fi
    local rest=(tests/test_gpu.py tests/test_quant.py) file failed=0
    local named=" $(echo $new_gpu_tests $kernel_tests) " # one space between names, not newlines
    for file in tests/test_*.py; do
        [[ "$named${rest[*]} " == *" $file "* ]] || rest+=("$file")
    done
    "${pytest[@]}" -m gpu $new_gpu_tests || failed=1
    "${pytest[@]}" -m "not gpu" $kernel_tests || failed=1 # their gpu-marked tests ran just before
    "${pytest[@]}" -m gpu "${rest[@]}" || failed=1
    return $failed
}

# --- the lease: the targets first, by what they are worth ---
export py device tokens lease_runs large scratch new_gpu_tests kernel_tests
export -f card kquant_decode gpu_tests # run by `timeout` through bash
step card lease 30 bash -c card
measure ceiling-8b-bf16 90 "$large" --no-generate --no-compiled
measure ceiling-1b-bf16 60 "$small" --no-generate --no-compiled
measure ceiling-8b-int4 90 "$large" --quant int4 --no-generate --no-compiled
streams streams-1b 75 "$small" 8
streams streams-8b 100 "$large" 16
step kquant-gemv lease 45 "$py" scripts/gpu_kquant.py --config "$large" --device "$device" \
    --types "${FIGURES_KQUANT_TYPES:-Q4_K,Q5_K,Q6_K,Q8_0,IQ4_XS}" ${FIGURES_KQUANT_SHAPES:+--shapes "$FIGURES_KQUANT_SHAPES"}
step kquant-decode lease 120 bash -c kquant_decode
measure spec-8b-lookup 90 "$large" --speculative lookup
step first-token-1b lease 60 "$py" scripts/gpu_first_token.py --config "$small" --device "$device" \
    --scratch "$scratch"
step first-token-8b lease 120 "$py" scripts/gpu_first_token.py --config "$large" --device "$device" \
    --scratch "$scratch"
step gpu-tests lease 100 bash -c gpu_tests

# --- the longer steps of earlier issues, by name or group ---
if wants gpu-tests-all tests; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt"
    "$py" -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >>"$out/gpu.txt"
    cat "$out/gpu.txt"
fi
step gpu-tests-all tests 330 "$py" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_quant.py
step kernels tests 150 "$py" scripts/bench_kernels.py
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
step families-cuda families 300 "$py" scripts/bench_families.py --device cuda --runs 3
speculative spec-1b-bf16-lookup spec-1b 150 llama-3.2-1b --speculative lookup
speculative spec-1b-bf16-self spec-1b 150 llama-3.2-1b --draft-model self
speculative spec-1b-int4-lookup spec-1b 150 llama-3.2-1b --quant int4 --speculative lookup
speculative spec-8b-bf16-self spec-8b 260 llama-3.1-8b --draft-model self
speculative spec-8b-int4-lookup spec-8b 170 llama-3.1-8b --quant int4 --speculative lookup

summarize
echo
cat "$out/table.md"
