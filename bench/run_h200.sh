#!/usr/bin/env bash
# Everything the H200 acceptance needs, in one device call: GPU tests, engine throughput (issue #2),
# profiles (issue #3), one process per profile. Results land in $1 (default /tmp/res).
set -u
R=${1:-/tmp/res}
mkdir -p "$R"
export KINETO_LOG_LEVEL=5 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$R/gpu.txt"
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -n 0 -q tests/engine/test_gpu_graphs.py -p no:cacheprovider > "$R/gpu_tests.txt" 2>&1; tail -1 "$R/gpu_tests.txt"
run() { local name=$1; shift; timeout 240 python3 bench/profile_h200.py "$name" "$R" -- "$@" > "$R/$name.log" 2>&1; tail -1 "$R/$name.log"; }
run profile_ouro-1.4b_c1 --model ouro -c 1
run profile_ouro-1.4b_c32 --model ouro -c 32 --set scheduler.max_num_seqs=32
run profile_huginn-0125_c1 --model huginn -c 1
timeout 240 python3 -m looptrace profile --model ouro -c 1 --compare base base --b-set cuda_graphs.enabled=false \
  -o "$R/compare_graphs_vs_eager_ouro-1.4b_c1.txt" > /dev/null 2> "$R/compare.log"; tail -3 "$R/compare.log"
[ "${SKIP_ENGINE:-0}" = 1 ] || timeout 300 python3 bench/engine_h200.py --out "$R/engine_h200.json" > "$R/engine.log" 2>&1; cat "$R/engine.log" | grep -v Warn
