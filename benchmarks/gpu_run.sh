#!/usr/bin/env bash
# One device-machine call: check the package under the GPU image's torch (2.11), then bench.
# Usage there: bash benchmarks/gpu_run.sh   (writes JSON results under $OUT)
set -x
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
R=$PWD; cd /tmp  # import the installed package, not the checkout's folders
python3 -c "import torch, fxcoalesce; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider $R/tests/test_analysis.py $R/tests/test_bucket_pass.py \
    $R/tests/test_pipeline.py $R/tests/test_ranks.py 2>&1 | tail -3
python3 -m fxcoalesce.cli inspect --model neox-tiny --tp 4 --out $OUT/inspect_neox
python3 -m fxcoalesce.cli bench --model neox-tiny --tp 2 --steps 100 --warmup 10 \
    --out $OUT/bench_neox_gloo_cpu.json
python3 -m fxcoalesce.cli bench --model neox-tiny --tp 2 --steps 100 --warmup 10 \
    --device cuda --backend gloo --out $OUT/bench_neox_gloo_cuda.json
python3 -m fxcoalesce.cli demo --device cuda --backend gloo 2>&1 | tail -12
