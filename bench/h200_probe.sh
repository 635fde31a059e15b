#!/usr/bin/env bash
# A short H200 call: GPU smoke (graph tests, diff on the tiny presets) plus a first look at the two arms at
# Ouro batch 1 (profile --compare and a 2-run paired bench). Results under $OUT.
set -u
bash bench/gpu_smoke.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m looptrace profile --model ouro -c 1 --compare base exactloop \
  -o "$OUT/profile_compare_ouro_c1.txt" 2> "$OUT/profile_compare.log"; echo "profile exit $?"; tail -5 "$OUT/profile_compare.log"
timeout 150 python3 -m looptrace bench --cell ouro:512/128@1 --runs 2 --format json \
  -o "$OUT/bench_ouro_c1.json" 2> "$OUT/bench.log"; echo "bench exit $?"; tail -8 "$OUT/bench.log"
# At most 8 files come back: fold every log into one.
cd "$OUT" && for f in *.log versions.txt gpu_graphs.txt diff_*_stderr.txt diff_exit.txt; do
  [ -f "$f" ] && { echo "=== $f"; cat "$f"; rm "$f"; }; done > logs.txt; ls
