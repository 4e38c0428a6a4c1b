#!/usr/bin/env bash
# EAGLE-3 on SmolLM2-135M on the GPU machine: train a draft head, then measure it. One stage
# per device call, each under the 10-minute limit; run from the repository root:
#
#   FXCOALESCE_SMOLLM2_GGUF=/tmp/smollm2.gguf bash benchmarks/gpu_spec.sh train   # ~7 min
#   FXCOALESCE_SMOLLM2_GGUF=/tmp/smollm2.gguf bash benchmarks/gpu_spec.sh tp1     # ~4 min
#   FXCOALESCE_SMOLLM2_GGUF=/tmp/smollm2.gguf bash benchmarks/gpu_spec.sh tp2     # ~5 min
#
# train  writes $OUT/head/ (config.json, index, safetensors shards <= 15 MiB, train_log.json)
#        as it goes (a checkpoint every minute) and copies it to /tmp/fxc-head
# tp1    one GPU, CUDA graphs; tp2: two GPUs, NCCL, the step compiled through fxcoalesce:
#        $OUT/spec_tp1.json / spec_tp2.json, rewritten after every prompt
# The head of tp1/tp2 is $2, else /tmp/fxc-head (a warm machine), else heads/smollm2-135m.
# Wheels the machine lacks (gguf) go in $WHEELS (default ./wheels); they are installed with
# the checkout into $SITE (default /tmp/site). Each stage logs to $OUT/<stage>.log.
# Knobs, GPU defaults: DEVICE=cuda MINUTES=5 PROMPTS=32 TOKENS=256
#   TRAIN_ARGS="--gen-batch 512" BENCH_ARGS="" TRAIN_TIMEOUT=480 BENCH_TIMEOUT=560
#   (the CPU dry run shrinks them: benchmarks/NOTES.md)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
stage=${1:?usage: gpu_spec.sh train|tp1|tp2 [HEAD]}
R=$PWD
: "${OUT:?OUT must name the output directory}"
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda} MINUTES=${MINUTES:-5} PROMPTS=${PROMPTS:-32} TOKENS=${TOKENS:-256}
TRAIN_ARGS=${TRAIN_ARGS:---gen-batch 512} BENCH_ARGS=${BENCH_ARGS:-}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-480} BENCH_TIMEOUT=${BENCH_TIMEOUT:-560}
WHEELS=${WHEELS:-$R/wheels} SITE=${SITE:-/tmp/site}
HEAD=${2:-}
if [ -z "$HEAD" ]; then
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

stage_main() {
    shopt -s nullglob
    run 300 python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target "$SITE" \
        "$R" "$WHEELS"/*.whl || return 1
    export PYTHONPATH=$SITE
    cd /tmp || return 1  # import the installed package, not the checkout's folders
    run 120 python3 -c "import torch, gguf, tokenizers, safetensors, yaml, jinja2, fxcoalesce
print('torch', torch.__version__, 'GPUs', torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
from fxcoalesce.apps import smollm2
print('GGUF', smollm2.gguf_path(), 'sha256 checked')" || return 1
    case $stage in
    train)
        run "$TRAIN_TIMEOUT" python3 -m fxcoalesce.apps.cli train-draft --out "$OUT/head" --device "$DEVICE" \
            --minutes "$MINUTES" $TRAIN_ARGS
        local rc=$?
        rm -rf /tmp/fxc-head && cp -r "$OUT/head" /tmp/fxc-head
        return $rc ;;
    tp1|tp2)
        run "$BENCH_TIMEOUT" python3 "$R/benchmarks/spec_bench.py" --draft "$HEAD" --tp "${stage#tp}" \
            --device "$DEVICE" --prompts "$PROMPTS" --tokens "$TOKENS" $BENCH_ARGS \
            --out "$OUT/spec_$stage.json" ;;
    *) echo "unknown stage $stage (train, tp1, tp2)"; return 2 ;;
    esac
}

stage_main 2>&1 | tee "$OUT/$stage.log"
exit "${PIPESTATUS[0]}"
