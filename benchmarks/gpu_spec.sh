#!/usr/bin/env bash
# EAGLE-3 on SmolLM2-135M on the GPU machine: train a draft head, then measure it. One or two
# stages per device call, each call under the 10-minute limit; run from the repository root.
#
#   bash benchmarks/gpu_spec.sh prep           # ~1 min: install, gather a GGUF part (one
#                                              #   call per part, back to back: warm machine)
#   bash benchmarks/gpu_spec.sh prep train     # ~8 min: the last part, then train (the
#                                              #   committed heads/smollm2-135m makes it optional)
#   bash benchmarks/gpu_spec.sh tp1            # ~4 min: one H200, CUDA graphs
#   bash benchmarks/gpu_spec.sh tp2            # ~5 min: two H200s, NCCL, through fxcoalesce
#   bash benchmarks/gpu_spec.sh tp1 tp1 tp1    # a stage named again runs again (caches warm:
#                                              #   ~1-2 min each), its outputs numbered; the
#                                              #   speedups of every run and their median last
#   bash benchmarks/gpu_spec.sh profile        # step_profile.py --compile on this GPU (TREE)
#
# tp1/tp2 size the tree as `fxcoalesce demo` does (spec_bench.py --tree auto: each candidate
# step timed here as a CUDA-graph replay, the head's acceptance, greedy where no tree is
# faster; apps/spec/treechoice.py); TREE=8,6,64 (or greedy, spec, measure) overrides it.
# TREE=8,7,96 was the fastest on an H100 (2.22x, accepted 3.62; auto's pick, 8,6,64: 2.08x,
# 3.44; benchmarks/results/gpu_h100x1_torch2.11_2026-12-06_session15/).
# The decision is cached under $FXCOALESCE_CACHE (default ~/.cache/fxcoalesce)/spec-tree.
# Both decodings' prefill is compiled on cuda (BENCH_ARGS="--prefill eager": as before 2026-12-06),
# and both launch each step before reading the last (BENCH_ARGS="--launch-ahead off": before).
#
# prep   installs the checkout and every wheel in carry/ (gguf) into $SITE (/tmp/site), and
#        copies carry/*.gguf.part-* to /tmp/fxc-gguf/; once the parts add up to the GGUF's
#        98362432 bytes it joins them (in name order) and checks the sha256. A call carries
#        at most 64 MiB with the checkout (heads/ is 21 MB of it): split in three, e.g.
#        `split -b 32787478 SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.Q4_1.gguf.part-`
# train  writes $OUT/head/ (config.json, index, safetensors shards <= 15 MiB, train_log.json)
#        as it goes (a checkpoint every minute) and copies it to /tmp/fxc-head
# tp1/2  $OUT/spec_tp1.json / spec_tp2.json, rewritten after every prompt (again: spec_tp1.2.json)
# profile  the greedy and the tree's step, draft and verify apart, compiled and captured in CUDA
#        graphs, and their top kernels (TREE, default 8,6,64; PROFILE_ARGS)
# The GGUF is $FXCOALESCE_SMOLLM2_GGUF, else /tmp/fxc-gguf's. The head of tp1/tp2 is $HEAD,
# else /tmp/fxc-head (a warm machine), else heads/smollm2-135m. Each stage logs to
# $OUT/<stage>.log. Knobs, GPU defaults: DEVICE=cuda MINUTES=5 PROMPTS=32 TOKENS=256
#   TRAIN_ARGS="--gen-batch 512" BENCH_ARGS="" TRAIN_TIMEOUT=420 BENCH_TIMEOUT=560
#   (the CPU dry run shrinks them: benchmarks/NOTES.md)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ $# -ge 1 ] || { echo "usage: gpu_spec.sh prep|train|tp1|tp2 ..."; exit 2; }
R=$PWD
: "${OUT:?OUT must name the output directory}"
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda} MINUTES=${MINUTES:-5} PROMPTS=${PROMPTS:-32} TOKENS=${TOKENS:-256}
TRAIN_ARGS=${TRAIN_ARGS:---gen-batch 512} BENCH_ARGS=${BENCH_ARGS:-}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-420} BENCH_TIMEOUT=${BENCH_TIMEOUT:-560} TREE=${TREE:-auto}
CARRY=${CARRY:-$R/carry} SITE=${SITE:-/tmp/site} GGUF_DIR=${GGUF_DIR:-/tmp/fxc-gguf}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
if [ -z "${HEAD:-}" ]; then
    if [ -d /tmp/fxc-head ]; then HEAD=/tmp/fxc-head; else HEAD=$R/heads/smollm2-135m; fi
fi

run() {  # a step under its own timeout; its exit status is the pipeline's
    local limit=$1; shift
    echo "+ [$(date +%T)] $*"
    timeout "$limit" "$@"
    local rc=$?
    echo "+ [$(date +%T)] exit $rc"
    return $rc
}

install() {
    shopt -s nullglob
    # setuptools copies a source into build/lib only where it is newer than the copy there: a
    # warm machine keeps build/ from the last call, and a file put back to an older version
    # (its checkout time) was not installed; that call ran the earlier code (session 10)
    rm -rf "$R/build/lib"
    run 300 python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target "$SITE" \
        "$R" "$CARRY"/*.whl || return 1
    export PYTHONPATH=$SITE
}

gguf_env() {  # the GGUF prep assembled, unless FXCOALESCE_SMOLLM2_GGUF names one
    if [ -z "${FXCOALESCE_SMOLLM2_GGUF:-}" ] && [ -f "$GGUF_DIR/$GGUF_NAME" ]; then
        export FXCOALESCE_SMOLLM2_GGUF=$GGUF_DIR/$GGUF_NAME
    fi
}

ready() {  # the GGUF found, the checkout installed, the libraries and the GPUs checked
    gguf_env
    install && (cd /tmp && check)
}

check() {  # the libraries, the GPUs, the GGUF's sha256
    run 120 python3 -c "import torch, gguf, tokenizers, safetensors, yaml, jinja2, fxcoalesce
print('torch', torch.__version__, 'GPUs', torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
from fxcoalesce.apps.spec import smollm2
print('GGUF', smollm2.gguf_path(), 'sha256 checked')"
}

stage() {
    local stage=$1
    case $stage in
    prep)
        shopt -s nullglob
        mkdir -p "$GGUF_DIR"
        for part in "$CARRY"/*.gguf.part-*; do cp "$part" "$GGUF_DIR/"; done
        ls -l "$GGUF_DIR"
        local parts=("$GGUF_DIR"/$GGUF_NAME.part-*)
        local have=0 p
        for p in "${parts[@]}"; do have=$((have + $(stat -c %s "$p"))); done
        if [ ! -f "$GGUF_DIR/$GGUF_NAME" ] && [ "$have" -eq 98362432 ]; then
            cat "${parts[@]}" > "$GGUF_DIR/$GGUF_NAME" && rm -f "${parts[@]}"
        fi
        install || return 1
        gguf_env
        if [ -n "${FXCOALESCE_SMOLLM2_GGUF:-}" ]; then
            (cd /tmp && check)
        else
            echo "GGUF incomplete: ${#parts[@]} part(s), $have of 98362432 bytes so far"
        fi ;;
    train)
        ready || return 1
        (cd /tmp && run "$TRAIN_TIMEOUT" python3 -m fxcoalesce.apps.cli train-draft \
            --out "$OUT/head" --device "$DEVICE" --minutes "$MINUTES" $TRAIN_ARGS)
        local rc=$?
        rm -rf /tmp/fxc-head && cp -r "$OUT/head" /tmp/fxc-head
        return $rc ;;
    tp1|tp2)
        ready || return 1
        (cd /tmp && run "$BENCH_TIMEOUT" python3 "$R/benchmarks/spec_bench.py" --draft "$HEAD" \
            --tp "${stage#tp}" --device "$DEVICE" --prompts "$PROMPTS" --tokens "$TOKENS" \
            --tree "$TREE" $BENCH_ARGS --out "$OUT/spec_$stage$RUN.json") ;;
    profile)
        ready || return 1
        local tree=$TREE
        [[ $tree =~ ^[0-9]+,[0-9]+,[0-9]+$ ]] || tree=8,6,64
        (cd /tmp && run "$BENCH_TIMEOUT" python3 "$R/benchmarks/step_profile.py" \
            --device "$DEVICE" --compile --tree "$tree" --head "$HEAD" ${PROFILE_ARGS:-}) ;;
    *) echo "unknown stage $stage (prep, train, tp1, tp2, profile)"; return 2 ;;
    esac
}

summary() {  # each tp run's speedup, and their median where a stage ran more than once
    python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
for tp in ("tp1", "tp2"):
    runs = sorted(pathlib.Path(sys.argv[1]).glob(f"spec_{tp}*.json"),
                  key=lambda f: (len(f.name), f.name))  # spec_tp1.json, then .2, .3
    got = [json.loads(f.read_text()) for f in runs]
    x = [g["speedup_vs_target_greedy"] for g in got if g.get("speedup_vs_target_greedy")]
    if len(x) > 1:
        print(f"{tp}: speedups {' '.join(f'{v:.2f}x' for v in x)}, median "
              f"{statistics.median(x):.2f}x over {len(x)} runs; past the prefill "
              f"{' '.join(str(g.get('speedup_past_prefill')) for g in got)}; accepted "
              f"{' '.join(str(g.get('mean_accepted')) for g in got)}")
PY
}

rc=0
declare -A seen=()
for s in "$@"; do
    seen[$s]=$(( ${seen[$s]:-0} + 1 ))
    RUN=""; [ "${seen[$s]}" -eq 1 ] || RUN=".${seen[$s]}"
    stage "$s" 2>&1 | tee "$OUT/$s$RUN.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || break
done
summary
exit "$rc"
