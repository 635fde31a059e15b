#!/usr/bin/env bash
# Issue #8 on the H200, in parts that each fit one device call (results under $OUT, logs folded into one
# file because at most 8 files come back):
#   bash bench/h200_table2.sh checks         GPU tests, diff base exactloop (tiny presets, CUDA)
#   bash bench/h200_table2.sh profile        profile --compare base exactloop, Ouro-1.4B batch 1
#   bash bench/h200_table2.sh kchecks        exact-kernel GPU tests (KSELECT, default "rmsnorm or rope") and graphs
#   bash bench/h200_table2.sh fused          the fused tails' GPU tests, graph tests, R0/R1 diffs, batch-1 profile
#   bash bench/h200_table2.sh p512           attention/packed GPU tests, attention timings, batch-1 profile of
#                                            both arms at prompt 512 (wall-time split)
#   bash bench/h200_table2.sh probe          exact-kernel launch variants, R0/R1-only diffs, exactloop
#                                            profile at 8 rows (bench/exact_variants_h200.py)
#   bash bench/h200_table2.sh kernels        exact-kernel timings per row bucket (bench/kernels_h200.py)
#                                            and attention timings (bench/attention_h200.py)
#   bash bench/h200_table2.sh "CELL ..."     paired Table 2 cells, e.g. "ouro:512/128@1,8 huginn:512/64@1"
#                                            (64 graphs on both arms; SIGINT at BENCH_TIMEOUT keeps the
#                                            completed cells); DIFFS=1 adds the tiny-preset diffs.
# The full Table 2 as four calls (the first two run back to back while the machine is warm):
#   checks | profile | "ouro:512/128@1,8,32,64" | "huginn:512/64@1,8,32,64" | "ouro:2048/64@8,32"
# then here: looptrace bench --from A.json --from B.json --from C.json -o bench/results/table2_h200.json
#            --plot bench/results/table2_h200.svg
set -u
# GPU tests run in one process (`-n 0`: pyproject's addopts spreads the CPU suite over two pytest-xdist
# workers, which the device image has; one GPU is better served by one process and one compile cache).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
LOG="$OUT/logs.txt"
# A Triton cache carried from the last call (.tcache/triton.tgz, excluded from git) saves the compiles.
if [ -f .tcache/triton.tgz ]; then mkdir -p ~/.triton && tar -xzf .tcache/triton.tgz -C ~/.triton; fi
trap 'tar -czf "$OUT/triton.tgz" -C ~/.triton cache 2>/dev/null' EXIT
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >> "$LOG"
if [ "$1" = checks ]; then
  timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -n 0 -m gpu tests/engine/test_gpu_graphs.py tests/engine/test_paged_attention_kernel.py \
    tests/engine/test_packed_attention_kernel.py \
    -p no:cacheprovider 2>&1 | tail -25 > "$OUT/gpu_tests_h200.txt"; tail -3 "$OUT/gpu_tests_h200.txt"
  for m in ouro-tiny huginn-tiny; do
    timeout "${DIFF_TIMEOUT:-100}" python3 -m looptrace diff base exactloop --model "$m" --device cuda \
      --format json -o "$OUT/diff_${m}_h200.json" 2>> "$LOG"; echo "diff $m exit $?" | tee -a "$LOG"
  done
elif [ "$1" = kchecks ]; then
  # The exact kernels' GPU tests (bitwise vs eager, eager calls and graph replays) and the graph tests.
  # (no -q: pyproject's addopts has one, and a second drops pytest's summary line)
  { [ "${KSELECT:-rmsnorm or rope}" = none ] || timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest -n 0 -m gpu \
      tests/engine/test_gpu_kernels.py -k "${KSELECT:-rmsnorm or rope}" -p no:cacheprovider 2>&1 | tail -2
    timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_gpu_graphs.py -p no:cacheprovider 2>&1 | tail -2
  } > "$OUT/gpu_tests_kernels_h200.txt"; cat "$OUT/gpu_tests_kernels_h200.txt"
elif [ "$1" = fused ]; then
  # The fused tails (kernels.residual_norm, kernels.rope_kv_write): their bitwise GPU tests, the graph
  # tests, the R0/R1-only diffs, then the batch-1 profile of both arms.
  { timeout 200 python3 -m pytest -n 0 -m gpu tests/engine/test_gpu_kernels.py -k "residual_norm or rope_kv_write" \
      -p no:cacheprovider 2>&1 | tail -4
    timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_gpu_graphs.py -p no:cacheprovider 2>&1 | tail -3
  } > "$OUT/gpu_tests_fused_h200.txt"; cat "$OUT/gpu_tests_fused_h200.txt"
  for m in ouro-tiny huginn-tiny; do
    timeout 70 python3 -m looptrace diff base exactloop --model "$m" --device cuda --b-set prefill.packed=false \
      --format json -o "$OUT/diff_r01_${m}_h200.json" 2>> "$LOG"; echo "diff r0/r1 $m exit $?" | tee -a "$LOG"
  done
  timeout -s INT "${PROFILE_TIMEOUT:-200}" python3 -m looptrace profile --model ouro -c 1 --compare base exactloop \
    -o "$OUT/profile_compare_ouro-1.4b_c1.txt" 2>> "$LOG"; echo "profile exit $?" | tee -a "$LOG"
  grep -A4 "┃ run" "$OUT/profile_compare_ouro-1.4b_c1.txt" | tail -3
elif [ "$1" = p512 ]; then
  # 64-row packed prefill blocks: the attention kernels' GPU tests and the prefill-graph tests, the
  # attention timings (packed blocks of 16..128 rows), then the batch-1 profile of both arms at the Table 2
  # prompt length (512), with the wall-time split.
  { timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py \
      tests/engine/test_packed_attention_kernel.py -p no:cacheprovider 2>&1 | tail -2
    timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_gpu_graphs.py -k prefill_graphs \
      -p no:cacheprovider 2>&1 | tail -2
  } > "$OUT/gpu_tests_packed_h200.txt"; cat "$OUT/gpu_tests_packed_h200.txt"
  [ "${SKIP_ATTENTION:-0}" = 1 ] || { timeout 170 python3 bench/attention_h200.py --budget-s 140 --out "$OUT" \
    >> "$LOG" 2>&1; echo "attention exit $?" | tee -a "$LOG"; }
  timeout -s INT "${PROFILE_TIMEOUT:-170}" python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 \
    --compare base exactloop -o "$OUT/profile_compare_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
  echo "profile exit $?" | tee -a "$LOG"; grep -A5 "GPU busy vs idle" "$OUT/profile_compare_ouro-1.4b_c1_p512.txt"
elif [ "$1" = probe ]; then
  # Diagnostics of one call: exact-kernel launch variants, the R0/R1-only diffs (exactloop without its
  # one R3 toggle, packed prefill: every stream must be identical), an exactloop profile at 8 rows.
  timeout "${VARIANTS_TIMEOUT:-200}" python3 bench/exact_variants_h200.py --budget-s "${VARIANTS_BUDGET:-170}" \
    --out "$OUT" >> "$LOG" 2>&1
  echo "variants exit $?" | tee -a "$LOG"; grep -c "|" "$OUT/exact_variants_h200.md"
  for m in ouro-tiny huginn-tiny; do
    timeout 70 python3 -m looptrace diff base exactloop --model "$m" --device cuda --b-set prefill.packed=false \
      --format json -o "$OUT/diff_r01_${m}_h200.json" 2>> "$LOG"; echo "diff r0/r1 $m exit $?" | tee -a "$LOG"
  done
  timeout -s INT 120 python3 -m looptrace profile --model ouro -c 8 --prompt-len 512 --recipe exactloop \
    -o "$OUT/profile_exactloop_ouro-1.4b_c8.txt" 2>> "$LOG"; echo "profile exit $?" | tee -a "$LOG"
elif [ "$1" = kernels ]; then
  mkdir -p "$OUT/kernels"
  timeout 250 python3 bench/kernels_h200.py --sections timings --budget-s 200 --out "$OUT/kernels" >> "$LOG" 2>&1
  echo "kernels exit $?" | tee -a "$LOG"
  timeout 250 python3 bench/attention_h200.py --budget-s 200 --out "$OUT" >> "$LOG" 2>&1
  echo "attention exit $?" | tee -a "$LOG"
elif [ "$1" = profile ]; then
  # PROFILE_C=8 PROFILE_PROMPT=512: the 8-row compare (bench/results/profile_compare_ouro-1.4b_c8.txt)
  c=${PROFILE_C:-1}
  timeout -s INT "${PROFILE_TIMEOUT:-500}" python3 -m looptrace profile --model ouro -c "$c" \
    ${PROFILE_PROMPT:+--prompt-len "$PROFILE_PROMPT"} --compare base exactloop \
    -o "$OUT/profile_compare_ouro-1.4b_c$c.txt" 2>> "$LOG"; echo "profile exit $?" | tee -a "$LOG"
  grep -A4 "┃ run" "$OUT/profile_compare_ouro-1.4b_c$c.txt" | tail -3
else
  args=(); for c in $1; do args+=(--cell "$c"); done
  name=$(echo "$1" | sed 's/[ :\/@,]/_/g')
  # SIGINT, not SIGTERM: an interrupted bench still writes the cells it completed. Table 2: 64 graphs.
  timeout -s INT "${BENCH_TIMEOUT:-560}" python3 -m looptrace bench "${args[@]}" --runs "${RUNS:-3}" \
    --set cuda_graphs.max_graphs=64 ${BENCH_ARGS:-} --format json \
    -o "$OUT/bench_$name.json" 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG"
fi
if [ "${DIFFS:-0}" = 1 ]; then
  for m in ouro-tiny huginn-tiny; do
    timeout "${DIFF_TIMEOUT:-100}" python3 -m looptrace diff base exactloop --model "$m" --device cuda --format json \
      -o "$OUT/diff_${m}_h200.json" 2>> "$LOG"; echo "diff $m exit $?" | tee -a "$LOG"
  done
fi
