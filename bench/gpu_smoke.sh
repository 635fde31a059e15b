#!/usr/bin/env bash
# One short H200 call: the GPU tests of the engine's CUDA paths and `looptrace diff base exactloop` on the
# tiny presets (loop fusion graphs, packed layout, packed prefill, exact kernels, fused projections on CUDA).
# Usage on the device: bash bench/gpu_smoke.sh  (results under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
timeout 70 python3 -m pytest -q -m gpu tests/engine/test_gpu_graphs.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_graphs.txt"
for m in ouro-tiny huginn-tiny; do
  timeout 45 python3 -m looptrace diff base exactloop --model "$m" --device cuda \
    --format json -o "$OUT/diff_${m}_h200.json" 2> "$OUT/diff_${m}_stderr.txt"
  echo "diff $m exit $?" | tee -a "$OUT/diff_exit.txt"
  tail -3 "$OUT/diff_${m}_stderr.txt"
done
