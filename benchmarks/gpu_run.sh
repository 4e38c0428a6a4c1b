#!/usr/bin/env bash
# One device-machine call: check the package under the GPU image's torch (2.11), then bench.
# Usage there: bash benchmarks/gpu_run.sh   (writes its log and JSON results under $OUT)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
R=$PWD; cd /tmp  # import the installed package, not the checkout's folders
run() { echo "+ $*"; timeout 150 "$@" 2>&1 | grep -v -i "warn\|  verify \|gathered ="; }
{
run python3 -c "import torch, fxcoalesce; print(torch.__version__, torch.cuda.get_device_name())"
run python3 -m pytest -q -p no:cacheprovider $R/tests/test_analysis.py \
    $R/tests/test_bucket_pass.py $R/tests/test_pipeline.py $R/tests/test_ranks.py
run python3 -m fxcoalesce.cli inspect --model neox-tiny --tp 4
run python3 -m fxcoalesce.cli bench --model neox-tiny --tp 2 --steps 50 --warmup 10 \
    --device cuda --backend gloo --out $OUT/bench_neox_gloo_cuda.json
run python3 -m fxcoalesce.cli demo --device cuda --backend gloo
} 2>&1 | tee $OUT/log
