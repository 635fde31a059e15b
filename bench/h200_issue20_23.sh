#!/usr/bin/env bash
# Issues #20 and #23 on the H200, in one device call (results under $OUT, at most 8 files come back):
#   bash bench/h200_issue20_23.sh roofline   looptrace profile --model ouro -c 1 --prompt-len 512 --recipe
#                                            exactloop: the per-op roofline columns (table and JSON)
#   bash bench/h200_issue20_23.sh diffs      looptrace diff base exactloop at real shape for huginn-0125 and
#                                            ouro-1.4b (-c 4 --prompt-len 128 --max-tokens 16): one engine
#                                            alive at a time, R0/R1 toggles identical
#   bash bench/h200_issue20_23.sh compare    trace compare of the base and exactloop profile traces (same shape)
#   bash bench/h200_issue20_23.sh gputests   the GPU tests of the sampling and graph paths (one process)
#   bash bench/h200_issue20_23.sh all        the three, in that order
# It installs the pydantic and plotext wheels from `.whl/` (the device image lacks them).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
LOG="$OUT/logs.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >> "$LOG"
git log -1 --format='commit %h %s' >> "$LOG" 2>/dev/null || true
part=${1:-all}

roofline() {
  local base="$OUT/profile_roofline_ouro-1.4b_c1_p512"
  timeout -s INT "${PROFILE_TIMEOUT:-200}" python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 \
    --recipe exactloop -o "$base.txt" 2>> "$LOG"; echo "profile txt exit $?" | tee -a "$LOG"
  timeout -s INT "${PROFILE_TIMEOUT:-200}" python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 \
    --recipe exactloop --format json -o "$base.json" 2>> "$LOG"; echo "profile json exit $?" | tee -a "$LOG"
}

diffs() {
  for m in huginn-0125 ouro-1.4b; do
    timeout -s INT "${DIFF_TIMEOUT:-240}" python3 -m looptrace diff base exactloop --model "$m" \
      --device cuda -c 4 --prompt-len 128 --max-tokens 16 --format json -o "$OUT/diff_${m}_c4_h200.json" \
      2>> "$LOG"; echo "diff $m exit $?" | tee -a "$LOG"
  done
  # A pool too small for the window: one error line naming the setting, exit 2.
  timeout 120 python3 -m looptrace diff base exactloop --model huginn-0125 --device cuda -c 4 --prompt-len 128 \
    --max-tokens 16 --a-set kv.gpu_memory_utilization=0.05 --b-set kv.gpu_memory_utilization=0.05 \
    >> "$LOG" 2>&1; echo "diff huginn-0125 at kv.gpu_memory_utilization=0.05 exit $?" | tee -a "$LOG"
  # One engine alive at a time: weakref liveness and the peak-memory bound.
  timeout 300 python3 -m pytest -n 0 -m gpu tests/cli/test_diff_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee -a "$LOG"
}

compare() {
  # base vs exactloop through `trace compare` on the two profile traces (kept in /tmp: they are large).
  for r in base exactloop; do
    timeout -s INT 200 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --recipe "$r" \
      --trace "/tmp/$r.json" -o "/tmp/profile_$r.txt" 2>> "$LOG"; echo "profile $r exit $?" | tee -a "$LOG"
  done
  timeout 200 python3 -m looptrace trace compare /tmp/base.json /tmp/exactloop.json --labels base,exactloop \
    -o "$OUT/trace_compare_base_vs_exactloop_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "compare exit $?" | tee -a "$LOG"
}

gputests() {
  timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -n 0 -m gpu ${GPU_TESTS:-tests/engine/test_gpu_graphs.py} \
    -p no:cacheprovider 2>&1 | tail -15 > "$OUT/gpu_tests_issue23_h200.txt"; tail -3 "$OUT/gpu_tests_issue23_h200.txt"
}

case "$part" in
  roofline) roofline ;;
  diffs) diffs ;;
  gputests) gputests ;;
  compare) compare ;;
  all) roofline; diffs; compare; gputests ;;
  *) echo "unknown part: $part (roofline | diffs | compare | gputests | all)" >&2; exit 2 ;;
esac
