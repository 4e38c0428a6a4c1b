#!/usr/bin/env bash
# The GPU bench matrix of issue 8 (2 H200s, torch 2.11, no network): NCCL TP 2, CUDA graphs
# on/off, NVLink and NCCL_P2P_DISABLE=1, verify steps of falcon-40b (full width, 4 layers,
# bf16), kimi-k2 (full width, 1 dense + 2 MoE layers, bf16), neox-tiny and kimi-k2-tiny.
# The whole matrix takes three or more ~9-minute calls (ONLY= picks runs). Runs go in
# priority order (the issue's named figures first), each under `timeout`, and a run starts
# only if the call's budget still holds its minimum; each result is added to $OUT as soon as
# its run ends.
#
#   bash benchmarks/gpu_bench.sh             on the GPU machine, from the checkout; results in $OUT
#   bash benchmarks/gpu_bench.sh --cpu       here: gloo on CPU, a tiny matrix, checks this script
#   ONLY=kimi_nvlink_cg_t16,neox_p2poff_cg bash benchmarks/gpu_bench.sh     chosen runs only
#   BUDGET=300 ...                           seconds for the whole call (default 530)
#   PROFILES=DIR ...                         calibrate_{p2poff,nvlink}.json when not made here
#
# $OUT gets (at most 8 files come back): log.txt (everything printed), results.jsonl (one
# bench.json record per line, with "run" and "exit"), summary.md (each run's bench.md, then
# the compact table), the first two runs' charts as <run>.png, calibrate_*.json, and
# <run>_trace_<variant>_t<tokens>.json for runs with --trace.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never multicast
# Inductor's FX graph cache stays on (fxcoalesce turns it off only for its own compiles), so
# a run in the second NCCL mode reuses the kernels compiled for the same graphs in the first.
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxc-inductor-cache}

MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
PY=${PY:-python3}
OUT=${OUT:-/tmp/fxc-gpu-bench}
BUDGET=${BUDGET:-530}
ONLY=${ONLY:-}
START=$(date +%s)
REPO=$(pwd)
# profiles this call did not calibrate come from here (ONLY= without the calibrate runs)
PROFILES=${PROFILES:-$REPO/benchmarks/results/gpu_h200x2_2026-11-30}
WORK=/tmp/fxc-bench-runs
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK"
: > "$OUT/results.jsonl"
: > "$OUT/summary.md"
: > "$OUT/log.txt"

left() { echo $((START + BUDGET - $(date +%s))); }

# bench RUN MIN LIMIT ARGS...: one `fxcoalesce bench` run named RUN, started only if at least
# MIN seconds of the budget are left, killed (with its ranks: timeout signals its whole
# process group) after LIMIT seconds or when the budget ends, whichever is first.
PNGS=0
bench() {
    local run=$1 min=$2 limit=$3
    shift 3
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$run,"* ]]; then return; fi
    local l
    l=$(left)
    if [ "$l" -lt "$min" ]; then
        echo "=== $run: skipped, ${l}s of the budget left (needs ${min}s)"
        return
    fi
    [ "$limit" -gt $((l - 5)) ] && limit=$((l - 5))
    local dir=$WORK/$run t0 rc
    t0=$(date +%s)
    echo "=== $run: fxcoalesce bench $* (limit ${limit}s, ${l}s left)"
    local mode profile=""
    mode=$(echo " $* " | sed -n 's/.* --nccl-mode \([a-z0-9-]*\) .*/\1/p')
    for f in "$OUT/calibrate_${mode//-/}.json" "$PROFILES/calibrate_${mode//-/}.json"; do
        [ -n "$mode" ] && [ -z "$profile" ] && [ -f "$f" ] && profile=$f
    done
    [ -n "$profile" ] && echo "    cost model: $profile"
    FXCOALESCE_PROFILE=$profile timeout -k 10 "$limit" "$PY" -m fxcoalesce.apps.cli bench "$@" \
        --out "$dir"
    rc=$?
    echo "=== $run: exit $rc after $(($(date +%s) - t0))s$([ $rc = 124 ] && echo ' (timed out)')"
    if [ -f "$dir/bench.json" ]; then
        "$PY" -c 'import json, sys
for rec in json.load(open(sys.argv[1])):
    print(json.dumps({"run": sys.argv[2], "exit": int(sys.argv[3]), **rec}))' \
            "$dir/bench.json" "$run" "$rc" >> "$OUT/results.jsonl"
        { echo "## $run (exit $rc)"; echo; cat "$dir/bench.md"; echo; } >> "$OUT/summary.md"
        if [ -f "$dir/bench.png" ] && [ $PNGS -lt 2 ]; then
            cp "$dir/bench.png" "$OUT/$run.png" && PNGS=$((PNGS + 1))
        fi
        for f in "$dir"/trace_*.json; do  # --trace runs: rank 0's profiler traces
            [ -f "$f" ] && cp "$f" "$OUT/${run}_$(basename "$f")"
        done
    fi
}

# calibrate RUN MIN LIMIT ARGS...: `fxcoalesce calibrate`, its profile kept as $OUT/RUN.json
calibrate() {
    local run=$1 min=$2 limit=$3
    shift 3
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$run,"* ]]; then return; fi
    local l
    l=$(left)
    if [ "$l" -lt "$min" ]; then
        echo "=== $run: skipped, ${l}s of the budget left (needs ${min}s)"
        return
    fi
    [ "$limit" -gt $((l - 5)) ] && limit=$((l - 5))
    echo "=== $run: fxcoalesce calibrate $* (limit ${limit}s)"
    timeout -k 10 "$limit" "$PY" -m fxcoalesce.apps.cli calibrate "$@" --out "$OUT/$run.json"
    echo "=== $run: exit $?"
}

table() {  # the compact table of everything measured, from results.jsonl
    "$PY" "$REPO/benchmarks/gpu_table.py" --compact "$OUT/results.jsonl"
}

main() {
    echo "gpu_bench.sh ($MODE), budget ${BUDGET}s, $(date -u +%FT%TZ)"
    rm -rf build  # setuptools' staging folder: a file deleted from the source would linger
    if [ $MODE = gpu ]; then
        "$PY" -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site . \
            || { echo "install failed"; return 1; }
    else  # the same install path, into its own folder
        "$PY" -m pip install -q --no-deps --no-build-isolation --upgrade \
            --target /tmp/fxc-site-cpu . || { echo "install failed"; return 1; }
    fi
    export PYTHONPATH=$([ $MODE = gpu ] && echo /tmp/site || echo /tmp/fxc-site-cpu)
    cd /tmp || return 1  # import the installed package, not the checkout's folders
    "$PY" -c 'import torch, fxcoalesce.apps.cli
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
if torch.cuda.is_available(): print("nccl", torch.cuda.nccl.version())' || return 1
    [ $MODE = gpu ] && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
        --format=csv

    if [ $MODE = cpu ]; then
        local c=(--tp 2 --backend gloo --device cpu --steps 5 --warmup 2)
        bench neox_cpu 60 240 "${c[@]}" --model neox-tiny --step verify --tokens 3 \
            --variants eager,inductor,fxcoalesce
        bench kimitiny_cpu 60 240 "${c[@]}" --model kimi-k2-tiny --step verify --tokens 3,4 \
            --variants eager,hand-merged
        bench killed_cpu 20 8 "${c[@]}" --model neox-tiny --variants inductor  # times out
        bench never_cpu 100000 60 "${c[@]}" --model neox-tiny  # skipped: budget
        calibrate calibrate_cpu 30 60 --tp 2 --backend gloo --device cpu --max-bytes 64K \
            --budget 0.2
    else
        local g=(--tp 2 --backend nccl --device cuda --steps 100 --warmup 5)
        local falcon=(--model falcon-40b --layers 4 --step verify)
        local kimi=(--model kimi-k2 --layers 3 --step verify)
        local main=eager,inductor,hand-merged,fxcoalesce
        # 0: the cost model's all_reduce profile in both NCCL modes, first: each bench run
        # below predicts its gain from the profile of its mode
        calibrate calibrate_p2poff 40 120 --tp 2 --backend nccl --device cuda \
            --nccl-mode p2p-off --max-bytes 32M --budget 0.5
        calibrate calibrate_nvlink 40 120 --tp 2 --backend nccl --device cuda \
            --nccl-mode nvlink --max-bytes 32M --budget 0.5
        # 1-2: the issue's named figures (p2p-off, CUDA graphs, 16 tokens)
        bench falcon_p2poff_cg_t16 90 220 "${g[@]}" "${falcon[@]}" --tokens 16 --cudagraphs \
            --nccl-mode p2p-off --variants $main
        bench kimi_p2poff_cg_t16 110 240 "${g[@]}" "${kimi[@]}" --tokens 16 --cudagraphs \
            --nccl-mode p2p-off --variants $main
        # 3-4: NVLink, with Inductor's own bucketing (the other variants hit the FX cache)
        bench falcon_nvlink_cg_t16 60 150 "${g[@]}" "${falcon[@]}" --tokens 16 --cudagraphs \
            --nccl-mode nvlink --variants $main,inductor-bucketing
        bench kimi_nvlink_cg_t16 70 170 "${g[@]}" "${kimi[@]}" --tokens 16 --cudagraphs \
            --nccl-mode nvlink --variants $main,inductor-bucketing
        # 5-6: the tiny models, all variants, three sizes
        bench neox_p2poff_cg 90 220 "${g[@]}" --model neox-tiny --step verify --tokens 3,16,64 \
            --cudagraphs --nccl-mode p2p-off
        bench kimitiny_p2poff_cg 90 220 "${g[@]}" --model kimi-k2-tiny --step verify \
            --tokens 3,16,64 --cudagraphs --nccl-mode p2p-off
        # 7-8: without CUDA graphs
        bench falcon_p2poff_t16 60 150 "${g[@]}" "${falcon[@]}" --tokens 16 --nccl-mode p2p-off \
            --variants $main
        bench kimi_p2poff_t16 70 170 "${g[@]}" "${kimi[@]}" --tokens 16 --nccl-mode p2p-off \
            --variants $main
        # 9-12: the other sizes and NVLink for the tiny models
        bench falcon_p2poff_cg_t3_64 90 200 "${g[@]}" "${falcon[@]}" --tokens 3,64 --cudagraphs \
            --nccl-mode p2p-off --variants $main
        bench kimi_p2poff_cg_t3_64 110 220 "${g[@]}" "${kimi[@]}" --tokens 3,64 --cudagraphs \
            --nccl-mode p2p-off --variants $main
        bench neox_nvlink_cg 90 220 "${g[@]}" --model neox-tiny --step verify --tokens 3,16,64 \
            --cudagraphs --nccl-mode nvlink
        bench kimitiny_nvlink_cg 90 220 "${g[@]}" --model kimi-k2-tiny --step verify \
            --tokens 3,16,64 --cudagraphs --nccl-mode nvlink
        # 13-14: the tiny models without CUDA graphs
        bench neox_p2poff 90 220 "${g[@]}" --model neox-tiny --step verify --tokens 3,16,64 \
            --nccl-mode p2p-off
        bench kimitiny_p2poff 90 220 "${g[@]}" --model kimi-k2-tiny --step verify \
            --tokens 3,16,64 --nccl-mode p2p-off
        # 15: profiler traces of the falcon figure's run (issue 8: evidence for its miss)
        bench falcon_p2poff_cg_t16_trace 90 200 "${g[@]}" "${falcon[@]}" --tokens 16 \
            --cudagraphs --nccl-mode p2p-off --variants inductor,hand-merged,fxcoalesce --trace
    fi
    echo
    echo "=== all results ($(($(date +%s) - START))s of ${BUDGET}s)"
    table | tee -a "$OUT/summary.md"
}

stamp() {  # each line with the seconds since the call began: where the time goes
    while IFS= read -r line; do printf '[%4d s] %s\n' "$(($(date +%s) - START))" "$line"; done
}

main 2>&1 | stamp | tee -a "$OUT/log.txt"
