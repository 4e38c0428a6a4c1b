#!/usr/bin/env bash
# The GPU bench matrix of issue 16 (H200s, torch 2.11, no network): first `fxcoalesce
# calibrate` with every implementation (NCCL, symm-mem one-shot / two-shot, the fused
# all_reduce + add + RMSNorm; each checked against NCCL on random inputs before any timing)
# in both NCCL modes, then `bench --device cuda --backend nccl --cudagraphs`, verify step at
# 3, 16 and 64 tokens, variants eager, inductor, inductor-one-shot, hand-merged, fxcoalesce,
# no-comm, for llama-3-8b (full depth), falcon-40b --layers 4 and kimi-k2 --layers 3 (full
# width, bf16), NVLink and NCCL_P2P_DISABLE=1; each bench run reads the profile its own
# mode calibrated (FXCOALESCE_PROFILE). Runs go in priority order (16 tokens first), each
# under `timeout`, and a run starts only if the call's budget still holds its minimum; each
# result is added to $OUT as soon as its run ends. The whole matrix takes several ~9-minute
# calls: ONLY= picks runs, and a later call on the same (warm) machine finds the profiles in
# /tmp/fxc-profiles.
#
#   bash benchmarks/gpu_bench.sh [--tp2]     two GPUs (the default): the TP 2 matrix
#   bash benchmarks/gpu_bench.sh --tp1       one GPU: calibrate and bench at world size 1 (an
#                                            NCCL group of one rank: what each implementation
#                                            costs a call, nothing moves between GPUs)
#   bash benchmarks/gpu_bench.sh --tp8       eight GPUs: P2P off first (the PCIe-like box)
#   bash benchmarks/gpu_bench.sh --cpu       here: gloo on CPU, tiny models; checks this script
#                                            and exits 1 if a step did not end as expected
#   ONLY=calibrate_tp2_nvlink,llama_nvlink_t16 bash benchmarks/gpu_bench.sh    chosen runs only
#   BUDGET=300 ...                           seconds for the whole call (default 530)
#   PROFILES=DIR ...                         calibrate_tp<N>_<mode>.json when not made here
#
# A run that needs more GPUs than the machine has (a kind with fewer GPUs was lent) is
# skipped with the reason; a run that hangs is killed by its timeout, with the last line it
# printed (where it was); a run that fails is noted and the next one starts. The closing
# table lists every run: done, or what is missing and why.
#
# $OUT gets (at most 8 files come back): log.txt (everything printed), results.jsonl (one
# bench.json record per line, with "run" and "exit"), summary.md (each run's bench.md, the
# status table, then the compact table), calibrate_tp<N>_<mode>.json, the first run's chart
# as <run>.png.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never multicast
# Inductor's FX graph cache stays on (fxcoalesce turns it off only for its own compiles, and
# inductor-one-shot for its own), so a run in the second NCCL mode reuses the kernels
# compiled for the same graphs in the first.
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxc-inductor-cache}

MODE=tp2
case "${1:-}" in
    --cpu) MODE=cpu ;;
    --tp1) MODE=tp1 ;;
    --tp2 | "") MODE=tp2 ;;
    --tp8) MODE=tp8 ;;
    *) echo "usage: gpu_bench.sh [--tp2 | --tp1 | --tp8 | --cpu]"; exit 2 ;;
esac
DEFAULT_PY=python3  # the GPU machine's; here the dev venv's (its setuptools builds wheels)
[ $MODE = cpu ] && [ -x .venv/bin/python ] && DEFAULT_PY=$PWD/.venv/bin/python
PY=${PY:-$DEFAULT_PY}
OUT=${OUT:-/tmp/fxc-gpu-bench}
BUDGET=${BUDGET:-530}
ONLY=${ONLY:-}
START=$(date +%s)
REPO=$(pwd)
PROFILES=${PROFILES:-$REPO/benchmarks/results}  # profiles this call did not calibrate
KEEP=/tmp/fxc-profiles  # ... or an earlier call on this machine did
WORK=/tmp/fxc-bench-runs
GPUS=0
mkdir -p "$OUT" "$KEEP" && rm -rf "$WORK" && mkdir -p "$WORK"
: > "$OUT/results.jsonl"
: > "$OUT/summary.md"
: > "$OUT/log.txt"
: > "$WORK/status.tsv"

left() { echo $((START + BUDGET - $(date +%s))); }

# status RUN STATUS DETAIL: one row of the closing table
status() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$WORK/status.tsv"; }

# can_start RUN MIN GPUS: whether RUN is chosen, the budget holds MIN seconds and the machine
# has GPUS GPUs (0: a CPU run); says why not (and records it) otherwise
can_start() {
    local run=$1 min=$2 need=$3 l
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$run,"* ]]; then return 1; fi
    if [ "$need" -gt "$GPUS" ]; then
        echo "=== $run: skipped, needs $need GPU(s), this machine has $GPUS"
        status "$run" skipped \
            "needs $need GPU(s), the machine has $GPUS (a kind with fewer GPUs was lent)"
        return 1
    fi
    l=$(left)
    if [ "$l" -lt "$min" ]; then
        echo "=== $run: skipped, ${l}s of the budget left (needs ${min}s)"
        status "$run" skipped \
            "budget: ${l}s left, needs ${min}s (run it in a later call: ONLY=$run)"
        return 1
    fi
}

# run_step RUN LIMIT LOG CMD...: CMD under `timeout` (its whole process group: the ranks too),
# its output also in LOG; sets RC and records the outcome
run_step() {
    local run=$1 limit=$2 log=$3 t0 last
    shift 3
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    RC=${PIPESTATUS[0]}
    last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)
    last=${last:-(it printed nothing)}
    local took=$(($(date +%s) - t0))
    echo "=== $run: exit $RC after ${took}s"
    case $RC in
        0) status "$run" done "${took}s" ;;
        124 | 137)
            status "$run" "timed out" "after ${took}s (limit ${limit}s), last line: $last" ;;
        *) status "$run" "exit $RC" "after ${took}s: $last" ;;
    esac
}

within_budget() {  # within_budget LIMIT: LIMIT, or what the budget leaves (less 5 s)
    local l
    l=$(left)
    if [ "$1" -gt $((l - 5)) ]; then echo $((l - 5)); else echo "$1"; fi
}

profile_of() {  # profile_of TP MODE: the calibrate profile of that setup, if any
    local name=calibrate_tp$1_${2//-/}.json f
    for f in "$OUT/$name" "$KEEP/$name" "$PROFILES/$name"; do
        [ -f "$f" ] && { echo "$f"; return; }
    done
}

# bench RUN MIN LIMIT GPUS ARGS...: one `fxcoalesce bench` run named RUN (the --tp and
# --nccl-mode of ARGS pick its profile), killed after LIMIT seconds or when the budget ends
PNGS=0
bench() {
    local run=$1 min=$2 limit=$3 need=$4
    shift 4
    can_start "$run" "$min" "$need" || return 0
    limit=$(within_budget "$limit")
    local l dir=$WORK/$run tp mode profile
    l=$(left)
    tp=$(echo " $* " | sed -n 's/.* --tp \([0-9]*\) .*/\1/p')
    mode=$(echo " $* " | sed -n 's/.* --nccl-mode \([a-z0-9-]*\) .*/\1/p')
    profile=$(profile_of "$tp" "${mode:-gloo}")
    echo "=== $run: fxcoalesce bench $* (limit ${limit}s, ${l}s left)"
    echo "    cost model: ${profile:-none (no calibrate_tp${tp}_${mode:-gloo}): the default}"
    FXCOALESCE_PROFILE=$profile run_step "$run" "$limit" "$WORK/$run.log" \
        "$PY" -m fxcoalesce.apps.cli bench "$@" --out "$dir"
    [ -z "$profile" ] && status "$run" note \
        "ran without its mode's profile (fxcoalesce lowered nothing)"
    if [ -f "$dir/bench.json" ]; then
        "$PY" -c 'import json, sys
for rec in json.load(open(sys.argv[1])):
    print(json.dumps({"run": sys.argv[2], "exit": int(sys.argv[3]), **rec}))' \
            "$dir/bench.json" "$run" "$RC" >> "$OUT/results.jsonl"
        { echo "## $run (exit $RC)"; echo; cat "$dir/bench.md"; echo; } >> "$OUT/summary.md"
        if [ -f "$dir/bench.png" ] && [ $PNGS -lt 1 ]; then
            cp "$dir/bench.png" "$OUT/$run.png" && PNGS=$((PNGS + 1))
        fi
    fi
}

# calibrate RUN MIN LIMIT GPUS ARGS...: `fxcoalesce calibrate`, its profile kept as
# $OUT/RUN.json (and in $KEEP for later calls on this machine)
calibrate() {
    local run=$1 min=$2 limit=$3 need=$4
    shift 4
    can_start "$run" "$min" "$need" || return 0
    limit=$(within_budget "$limit")
    echo "=== $run: fxcoalesce calibrate $* (limit ${limit}s)"
    run_step "$run" "$limit" "$WORK/$run.log" \
        "$PY" -m fxcoalesce.apps.cli calibrate "$@" --out "$OUT/$run.json"
    [ "$RC" = 0 ] && cp "$OUT/$run.json" "$KEEP/$run.json"
}

# matrix TP GPUS MODES...: calibrate each mode, then the three models at 16, 3, 64 tokens
matrix() {
    local tp=$1 need=$2 m t
    shift 2
    local g=(--tp "$tp" --backend nccl --device cuda --step verify --cudagraphs --steps 100
             --warmup 5 --variants eager,inductor,inductor-one-shot,hand-merged,fxcoalesce,no-comm)
    for m in "$@"; do
        calibrate "calibrate_tp${tp}_${m//-/}" 60 240 "$need" --tp "$tp" --backend nccl \
            --device cuda --nccl-mode "$m"
    done
    local tag=""
    [ "$tp" != 2 ] && tag="_tp$tp"
    for t in 16 3 64; do
        for m in "$@"; do
            bench "llama${tag}_${m//-/}_t$t" 200 420 "$need" "${g[@]}" --model llama-3-8b \
                --tokens "$t" --nccl-mode "$m"
        done
        for m in "$@"; do
            bench "falcon${tag}_${m//-/}_t$t" 100 240 "$need" "${g[@]}" --model falcon-40b \
                --layers 4 --tokens "$t" --nccl-mode "$m"
            bench "kimi${tag}_${m//-/}_t$t" 110 260 "$need" "${g[@]}" --model kimi-k2 \
                --layers 3 --tokens "$t" --nccl-mode "$m"
        done
    done
}

closing_table() {
    echo "| run | status | detail |"
    echo "|---|---|---|"
    awk -F'\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$WORK/status.tsv"
    local missing
    missing=$(awk -F'\t' '$2 != "done" && $2 != "note"' "$WORK/status.tsv" | wc -l)
    echo
    echo "$missing run(s) missing or incomplete (status other than done)"
}

# cpu_expected: in --cpu mode, each step must end as planned (the script's own check)
cpu_expected() {
    local want=("calibrate_tp2_gloo done" "neox_cpu done" "kimitiny_cpu done"
                "killed_cpu timed out" "never_cpu skipped" "gpu_cpu skipped") w bad=0
    for w in "${want[@]}"; do
        local run=${w%% *} st=${w#* }
        if ! awk -F'\t' -v r="$run" -v s="$st" '$1 == r && $2 == s {f=1} END {exit !f}' \
                "$WORK/status.tsv"; then
            echo "CHECK FAILED: $run did not end as '$st'"; bad=1
        fi
    done
    "$PY" - "$OUT/results.jsonl" <<'EOF' || bad=1
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
neox = [r for r in recs if r["run"] == "neox_cpu"]
assert neox, "no neox_cpu record"
v = neox[0]["variants"]
assert v["no-comm"]["wrong_by_design"] and v["no-comm"]["all_reduce_launches"] == 0, v["no-comm"]
assert all("exposed_comm_ms" in x for x in v.values()), "exposed_comm_ms missing"
assert "inductor-one-shot" in neox[0]["skipped"], neox[0]["skipped"]
for key in ("torch", "date", "gpu", "driver", "nccl", "nccl_mode", "profile"):
    assert key in neox[0], f"record without {key!r}"
assert neox[0]["profile"].endswith("calibrate_tp2_gloo.json"), neox[0]["profile"]
print("cpu check: records hold no-comm (wrong by design, 0 all_reduces), exposed_comm_ms, "
      "the inductor-one-shot skip note and the provenance fields")
EOF
    return $bad
}

main() {
    echo "gpu_bench.sh ($MODE), budget ${BUDGET}s, $(date -u +%FT%TZ)"
    rm -rf build  # setuptools' staging folder: a file deleted from the source would linger
    local site=/tmp/site
    [ $MODE = cpu ] && site=/tmp/fxc-site-cpu  # the same install path, into its own folder
    "$PY" -m pip install -q --no-deps --no-build-isolation --upgrade --target $site . \
        || { echo "install failed"; return 1; }
    export PYTHONPATH=$site
    cd /tmp || return 1  # import the installed package, not the checkout's folders
    "$PY" -c 'import torch, fxcoalesce.apps.cli
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
if torch.cuda.is_available(): print("nccl", torch.cuda.nccl.version())' || return 1
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    [ "$GPUS" -gt 0 ] && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
        --format=csv
    "$PY" -c 'import fxcoalesce.kernels' 2>/dev/null \
        || echo "note: fxcoalesce.kernels does not import: calibrate leaves the fused op out"

    case $MODE in
        cpu)
            local c=(--tp 2 --backend gloo --device cpu --steps 5 --warmup 2)
            calibrate calibrate_tp2_gloo 30 90 0 --tp 2 --backend gloo --device cpu \
                --max-bytes 64K --budget 0.2
            bench neox_cpu 60 300 0 "${c[@]}" --model neox-tiny --step verify --tokens 3 \
                --variants eager,inductor-one-shot,fxcoalesce,no-comm
            bench kimitiny_cpu 60 240 0 "${c[@]}" --model kimi-k2-tiny --step verify \
                --tokens 3 --variants eager,hand-merged
            bench killed_cpu 30 25 0 "${c[@]}" --model neox-tiny --variants eager \
                --steps 1000000  # times out, whatever the caches hold
            bench never_cpu 100000 60 0 "${c[@]}" --model neox-tiny  # skipped: budget
            bench gpu_cpu 10 60 2 --tp 2 --backend nccl --device cuda  # skipped: no GPU here
            ;;
        tp1) matrix 1 1 nvlink ;;
        tp2) matrix 2 2 nvlink p2p-off ;;
        tp8) matrix 8 8 p2p-off nvlink ;;
    esac
    echo
    echo "=== all results ($(($(date +%s) - START))s of ${BUDGET}s)"
    { echo "## status"; echo; closing_table; echo; } | tee -a "$OUT/summary.md"
    "$PY" "$REPO/benchmarks/gpu_table.py" --compact "$OUT/results.jsonl" | tee -a "$OUT/summary.md"
    if [ $MODE = cpu ]; then
        cpu_expected
    fi
}

stamp() {  # each line with the seconds since the call began: where the time goes
    while IFS= read -r line; do printf '[%4d s] %s\n' "$(($(date +%s) - START))" "$line"; done
}

main 2>&1 | stamp | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
