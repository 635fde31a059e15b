#!/usr/bin/env bash
# The GPU machine's one script: each mode fits one device call (at most 10 minutes) and writes its results
# under $OUT, with $OUT/commands.txt (date, commit, versions, device, command, exit code of every
# measurement, written by bench/run.py) and $OUT/logs.txt (the commands' stderr).
#
#   bash bench/device.sh tests [PYTEST ARGS]   the GPU tests (default: every `-m gpu` test; LIMIT_S, default
#                                              560) -> gpu_tests_CARD.txt
#   bash bench/device.sh token [ARGS]          the synthetic Ouro decode token (bench/token_ablation.py ARGS)
#   bash bench/device.sh profiles              profile --compare exactloop fast and base exactloop, Ouro
#                                              batch 1, prompt 512
#   bash bench/device.sh table2 [CELLS]        paired base vs exactloop: the paper's Table 2 cells, or the
#                                              CELLS given ("ouro:512/128@1,8 huginn:512/64@1"), 3 runs
#   bash bench/device.sh fast-cells            paired exactloop vs fast, Ouro 512/128 at C = 1, 8, 32
#   bash bench/device.sh diffs                 diff exactloop fast at real shape; diff base exactloop (tiny)
#   bash bench/device.sh kernels               decode attention, GEMV and exact-kernel micro-benchmarks
#   bash bench/device.sh gemv-batch [ARGS]     the GEMV's many-row tiles swept at 8 rows, then fast vs
#                                              fast + kernels.gemv_batch at C = 8 (bench/gemv_batch.py
#                                              ARGS; LIMIT_S=seconds, default 500)
#   bash bench/device.sh persistent-loop [ARGS] the persistent Ouro loop kernel alone (bench/kernel_persistent_loop.py)
#   bash bench/device.sh persistent-loop-faults [ARGS] which launch shapes and engine runs of it fault
#   bash bench/device.sh reference-judge       serve Ouro-1.4B in bf16, judged by our fp32 engine on the GPU
#
# CARD (h100, h200, ...) is read from nvidia-smi; file results under bench/results/CARD/WHAT/ as
# DATE_COMMIT_NAME (bench/results/README.md). Where the machine has no pydantic or plotext, wheels placed
# in .whl/ are installed first; a Triton cache in .tcache/triton.tgz is restored and the new one written
# to $OUT/triton.tgz, so the next call compiles nothing it compiled before.
set -u
MODE=${1:-}
shift || true
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
LOG="$OUT/logs.txt"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o '[HABL][0-9]\+' | tr 'A-Z' 'a-z')
CARD=${CARD:-gpu}
if [ -f .tcache/triton.tgz ]; then mkdir -p ~/.triton && tar -xzf .tcache/triton.tgz -C ~/.triton; fi
trap 'tar -czf "$OUT/triton.tgz" -C ~/.triton cache 2>/dev/null' EXIT

# measure SECONDS MODE [ARGS...]: `bench/run.py MODE` under a time limit. SIGINT, not SIGTERM: an
# interrupted `looptrace bench` or `profile` still writes what it completed.
measure() {
  local limit=$1; shift
  timeout -s INT "$limit" python3 bench/run.py --out "$OUT" "$@" 2>> "$LOG"
  echo "$1 exit $?"
}

case "$MODE" in
  tests)
    # One process (`-n 0`): one GPU is better served by one process and one compile cache.
    { python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
      git rev-parse --short HEAD 2>/dev/null
      timeout "${LIMIT_S:-560}" python3 -m pytest -n 0 -m gpu -p no:cacheprovider "${@:-tests}" 2>&1 | tail -25
    } > "$OUT/gpu_tests_$CARD.txt"
    tail -3 "$OUT/gpu_tests_$CARD.txt" ;;
  token)
    measure 560 token -- "$@"
    cat "$OUT/token_ablation.md" 2>/dev/null ;;
  profiles)
    measure 200 profile
    measure 250 profile-base
    grep -h -A6 "GPU busy" "$OUT"/profile_compare_*_ouro-1.4b_c1_p512.txt ;;
  table2)
    if [ $# -eq 0 ]; then
      measure 580 table2
    else
      cells=(); for c in $1; do cells+=(--cell "$c"); done
      measure 580 cells -- "${cells[@]}"
    fi
    grep "B/A" "$LOG" | tail -12 ;;
  fast-cells)
    measure 400 fast-cells ;;
  diffs)
    measure 120 diff-fast
    measure 200 diff-base ;;
  kernels)
    measure 200 attention -- --budget-s 150
    measure 200 gemv -- --budget-s 150
    measure 180 exact-kernels -- --sections timings --budget-s 140 ;;
  gemv-batch)
    measure "${LIMIT_S:-500}" gemv-batch -- "$@"
    cat "$OUT/gemv_batch.md" 2>/dev/null ;;
  persistent-loop)
    measure 560 persistent-loop -- "$@"
    cat "$OUT/persistent_loop.md" 2>/dev/null ;;
  persistent-loop-faults)
    measure 560 persistent-loop-faults -- "$@"
    cat "$OUT/persistent_loop_faults.md" 2>/dev/null ;;
  reference-judge)
    measure 580 reference-judge
    cat "$OUT/reference_judge_summary.json" 2>/dev/null ;;
  *)
    echo "bench/device.sh: unknown mode '${MODE}' (tests, token, profiles, table2, fast-cells, diffs, kernels, gemv-batch, persistent-loop, persistent-loop-faults, reference-judge)" >&2
    exit 2 ;;
esac
