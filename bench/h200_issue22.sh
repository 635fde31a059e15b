#!/usr/bin/env bash
# Issue #22 on the H200, in parts that each fit one device call (results under $OUT):
#   bash bench/h200_issue22.sh attention   split-KV attention GPU tests, its timings beside the kernel it
#                                          replaced (bench/paged_attention_45c1321.py, made here with
#                                          `git show 45c1321:looptrace/engine/kernels/paged_attention.py`),
#                                          diff base exactloop (tiny presets), profile --compare base
#                                          exactloop at Ouro-1.4B batch 1 prompt 512
#   bash bench/h200_issue22.sh explore     the attention split-config sweep, the L2-prefetch token bench
#   bash bench/h200_issue22.sh pdl         kernels.pdl: GPU tests, token bench, profiles, diff, bench cells
#   bash bench/h200_issue22.sh fast_pdl    fast with kernels.pdl: GPU tests, profiles, diff, bench vs exactloop
#   bash bench/h200_issue22.sh fused       kernels.gemv_silu / gemv_norm: GPU tests, profile and diff of fast
#                                          with and without them
#   bash bench/h200_issue22.sh fused_pick  gemv_silu alone vs neither; exactloop vs the faster fast (profile, bench)
#   bash bench/h200_issue22.sh preload     kernels.gemv_preload: token bench, profile, diff, GPU tests
#   bash bench/h200_issue22.sh spikes      bench exactloop vs fast with compile / GC / round recorders
#   bash bench/h200_issue22.sh fast_cells  profile --compare exactloop fast, bench exactloop vs fast (C = 1, 8, 32)
#   bash bench/h200_issue22.sh slots_sweep decode attention: the per-key-slot configs swept beside the current ones
#   bash bench/h200_issue22.sh attn_diag   decode attention launch floors, then ncu on the kernel at four shapes
#   bash bench/h200_issue22.sh ablation    the synthetic Ouro token: ops left out one at a time, the GEMV's deeper
#                                          weight preload, the attention's K/V prefetch before its wait, key
#                                          slots; then the attention launch floors
#   bash bench/h200_issue22.sh early       GPU tests of the kernels touched (attention refactor + early tiles, since
#                                          removed; the GEMV's preload depth; the PDL chains), then the ablation bench
#   bash bench/h200_issue22.sh slots       key slots as Ouro's attention: the slots sweep, the attention GPU tests,
#                                          the synthetic token (plain vs slots, attn_prefetch, exact with PDL)
#   bash bench/h200_issue22.sh final5      attention GPU tests (Huginn's key-slot split), attention timings beside the
#                                          session-4 kernel (bench/paged_attention_2e6f966.py, made here with `git
#                                          show 2e6f966:looptrace/engine/kernels/paged_attention.py`), bench
#                                          exactloop vs fast (Ouro C = 1, 8, 32)
#   bash bench/h200_issue22.sh engine5     the engine as committed in session 5: profile --compare exactloop fast,
#                                          diffs (exactloop fast at real shape and ouro-tiny; attn_prefetch R0;
#                                          base exactloop with the key-slot attention), bench exactloop vs fast
#   bash bench/h200_issue22.sh outforms    session 6: the GEMV's fused output forms (kernels.gemv_silu_out,
#                                          gemv_norm_out): GPU tests, the synthetic token with them, the GEMV-only
#                                          chain's tile sweep, profile --compare fast without / with them, their
#                                          R0 diff at real shape
#   bash bench/h200_issue22.sh onepass     session 6: the residual norm in one pass (GPU tests of the changed
#                                          kernels), the synthetic token (steps vs one pass, silu-out, the tuned
#                                          GEMV tiles, norm-out; exact), the tuned tiles in the GEMV-only chain,
#                                          profile --compare exactloop fast
#   bash bench/h200_issue22.sh final6      session 6 as committed: GPU tests (GEMV, output forms, PDL), the token
#                                          (fast vs session 5's tiles; exact), profile --compare exactloop fast,
#                                          diffs (exactloop fast at real shape and ouro-tiny; gemv_silu_out R0),
#                                          bench exactloop vs fast (Ouro C = 1, 8, 32)
#   bash bench/h200_issue22.sh explore7    session 7: the GEMV's L2 prefetch of its next tiles before the PDL wait
#                                          (TileConfig.prefetch_tiles) and o / down without the split-K tail: PDL
#                                          GPU tests, the GEMV-only chain (--gemv-sweep7), the synthetic token
#   bash bench/h200_issue22.sh final7      session 7 as committed: GPU tests (PDL, GEMV, output forms), the token
#                                          (fast6 vs fast7; exact), profile --compare exactloop fast and base
#                                          exactloop, diffs (exactloop fast; gemv_preload R0) at real shape
#   bash bench/h200_issue22.sh quick7      the GEMV prefetch depths and o / down unsplit in the token, fast's profile (one short call)
#   bash bench/h200_issue22.sh cells7      bench exactloop vs fast (Ouro C = 1, 8, 32), base vs exactloop Huginn C = 32
#   bash bench/h200_issue22.sh h200_8      if an H200 comes: the token with RoPE (launch vs folded; exact), profile
#                                          --compare exactloop fast and base exactloop, Huginn C = 32 base vs exactloop
#   bash bench/h200_issue22.sh card8       session 8, on whichever card is lent (H100 or H200): every GPU test, the
#                                          token (fast6, fast7, exact; the card's copy bandwidth measured),
#                                          profile --compare base exactloop, diff exactloop fast at real shape
#   bash bench/h200_issue22.sh rope9       session 9: kernels.gemv_rope_out (the q/k/v GEMV does RoPE + the K/V
#                                          write): its GPU tests, the token with RoPE (launch vs folded; exact),
#                                          profile --compare fast without / with it, its R0 diff at real shape,
#                                          bench fast without / with it (Ouro C = 1)
#   bash bench/h200_issue22.sh card11      session 11, fast as committed (with gemv_rope_out), on whichever card
#                                          is lent: the token (fast6 rope / rope-out, exact rope; the card's copy
#                                          bandwidth), profile --compare exactloop fast, bench exactloop vs fast
#                                          (Ouro C = 1, 8, 32), diff exactloop fast on ouro-tiny (accuracy); on an
#                                          H200 also profile --compare base exactloop
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
LOG="$OUT/logs.txt"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00' | tr H h)  # file suffix
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"
# profile --compare exactloop fast at Ouro-1.4B batch 1, prompt 512 (the TPOT targets' figure)
profile_exactloop_fast() {
  profile_compare exactloop fast
}
# profile_compare A B: `looptrace profile --compare A B` at Ouro-1.4B batch 1, prompt 512
profile_compare() {
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare "$1" "$2" \
    -o "$OUT/profile_compare_$1_$2_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile $1 $2 exit $?"
  grep -h -A6 "Decode window, per output token: GPU busy" "$OUT/profile_compare_$1_$2_ouro-1.4b_c1_p512.txt"
}
# diff_real STEM DIFF-ARGS...: `looptrace diff DIFF-ARGS` at Ouro-1.4B's real shape, 4 requests x 16 tokens
diff_real() {
  local stem=$1; shift
  timeout -s INT 70 python3 -m looptrace diff "$@" --model ouro-1.4b --device cuda -c 4 --prompt-len 128 \
    --max-tokens 16 --format json -o "$OUT/diff_${stem}_ouro-1.4b_c4_${CARD:-gpu}.json" > /dev/null 2>> "$LOG"
  echo "diff $stem exit $?"; grep -A3 '"summary"' "$OUT/diff_${stem}_ouro-1.4b_c4_${CARD:-gpu}.json" | head -6
}
if [ "$1" = attention ]; then
  timeout 240 python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py -p no:cacheprovider 2>&1 \
    | tail -15 > "$OUT/gpu_tests_split_kv_h200.txt"; tail -3 "$OUT/gpu_tests_split_kv_h200.txt"
  timeout 150 python3 bench/decode_attention_h200.py --old bench/paged_attention_45c1321.py --out "$OUT" >> "$LOG" 2>&1
  echo "attention exit $?"; head -40 "$OUT/decode_attention_h200.md"
  for m in ouro-tiny huginn-tiny; do
    timeout 80 python3 -m looptrace diff base exactloop --model "$m" --device cuda --format json \
      -o "$OUT/diff_${m}_h200.json" 2>> "$LOG"; echo "diff $m exit $?"
  done
  timeout -s INT 150 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare base exactloop \
    -o "$OUT/profile_compare_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  grep -B2 -A14 "┃ run" "$OUT/profile_compare_ouro-1.4b_c1_p512.txt" | head -34
fi
if [ "$1" = explore ]; then
  # One call (the device is scarce): GPU tests of the changed kernels; the attention split-config sweep;
  # the L2-prefetch token bench; profile --compare exactloop fast (fast = exactloop + gemv + l2_prefetch);
  # diff exactloop fast at real shape; bench exactloop vs fast at the Ouro C = 1, 8, 32 cells.
  timeout 60 python3 -m pytest -n 0 -m gpu tests/engine/test_l2_prefetch.py tests/engine/test_paged_attention_kernel.py \
    -p no:cacheprovider 2>&1 | tail -4 | tee -a "$LOG"
  timeout 95 python3 bench/decode_attention_h200.py --sweep --budget-s 70 --out "$OUT" >> "$LOG" 2>&1
  echo "sweep exit $?"; head -40 "$OUT/attention_sweep_h200.md"
  timeout 70 python3 bench/l2_prefetch_h200.py --rows 1 --only "cublas,cublas+pf1 p8 32K,gemv,gemv+pf1 p8 32K" \
    --out "$OUT" >> "$LOG" 2>&1; echo "l2 r1 exit $?"; cat "$OUT/l2_prefetch_h200_r1.md"; rm -f "$OUT/l2_prefetch_h200_r1.json"
  timeout -s INT 130 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare exactloop fast \
    -o "$OUT/profile_compare_exactloop_fast_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
  echo "profile exit $?"; grep -A5 "GPU busy vs idle" "$OUT/profile_compare_exactloop_fast_ouro-1.4b_c1_p512.txt"
  timeout -s INT 60 python3 -m looptrace diff exactloop fast --model ouro-1.4b --device cuda -c 4 --prompt-len 128 \
    --max-tokens 16 --format json -o "$OUT/diff_exactloop_fast_ouro-1.4b_c4_h200.json" 2>> "$LOG"
  echo "diff fast exit $?"
  timeout -s INT "${BENCH_TIMEOUT:-170}" python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 \
    --runs 2 --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG" | tail -4
fi
if [ "$1" = final ]; then
  # After the sweep: the chosen split configs' GPU tests and timings beside the pre-split kernel
  # (bench/paged_attention_45c1321.py, copied in by the caller), diff base exactloop (ouro-tiny), both
  # batch-1 profile compares, exactloop vs fast at the Ouro cells, then Table 2 (base vs exactloop) until
  # the time runs out (SIGINT keeps the completed cells).
  timeout 90 python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py tests/engine/test_gemv_kernel.py \
    -p no:cacheprovider 2>&1 | tail -4 > "$OUT/gpu_tests_final_h200.txt"; cat "$OUT/gpu_tests_final_h200.txt"
  timeout 40 python3 bench/decode_attention_h200.py --old bench/paged_attention_45c1321.py --out "$OUT" >> "$LOG" 2>&1
  echo "attention exit $?"; rm -f "$OUT/decode_attention_h200.json"
  timeout 40 python3 -m looptrace diff base exactloop --model ouro-tiny --device cuda 2>&1 | tail -2 | tee -a "$LOG"
  for pair in "base exactloop" "exactloop fast"; do
    name=$(echo "$pair" | tr ' ' _)
    timeout -s INT 70 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare $pair \
      -o "$OUT/profile_compare_${name}_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
    echo "profile $pair exit $?"; grep -A5 "GPU busy vs idle" "$OUT/profile_compare_${name}_ouro-1.4b_c1_p512.txt"
  done
  timeout -s INT 75 python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 --runs 2 \
    --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" 2>> "$LOG"
  echo "bench fast exit $?"
  timeout -s INT "${TABLE2_TIMEOUT:-165}" python3 -m looptrace bench --cell ouro:512/128@1,8,32,64 \
    --cell huginn:512/64@32,64,1,8 --cell ouro:2048/64@8,32 --runs 2 --set cuda_graphs.max_graphs=64 \
    --format json -o "$OUT/bench_table2.json" 2>> "$LOG"
  echo "table2 exit $?"; grep "B/A" "$LOG" | tail -14
fi
if [ "$1" = full ]; then
  # The fence check, the kernels' GPU tests, the GEMV and attention timings, then the fast recipe.
  timeout 60 python3 bench/diag_splitkv.py 2>&1 | tee "$OUT/diag_splitkv.txt"
  timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py tests/engine/test_gemv_kernel.py \
    -p no:cacheprovider --tb=line 2>&1 | tail -40 > "$OUT/gpu_tests_issue22_h200.txt"; tail -4 "$OUT/gpu_tests_issue22_h200.txt"
  timeout 110 python3 bench/gemv_h200.py --budget-s 75 --out "$OUT" > "$OUT/gemv_log.txt" 2>&1; echo "gemv exit $?"
  timeout 50 python3 bench/decode_attention_h200.py --old bench/paged_attention_45c1321.py --out "$OUT" >> "$LOG" 2>&1
  echo "attention exit $?"
  timeout -s INT 140 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare exactloop fast \
    -o "$OUT/profile_compare_fast_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  grep -A5 "GPU busy vs idle" "$OUT/profile_compare_fast_ouro-1.4b_c1_p512.txt" | head -7
  timeout 60 python3 -m looptrace diff exactloop fast --model ouro-tiny --device cuda --format json \
    -o "$OUT/diff_exactloop_fast_ouro-tiny_h200.json" 2>> "$LOG"; echo "diff fast exit $?"
  cat "$OUT/gemv_log.txt" >> "$LOG"; rm -f "$OUT/gemv_log.txt"
fi
if [ "$1" = pdl ]; then
  # kernels.pdl (R0): its GPU tests with the kernels whose signatures it touched, the synthetic-token bench,
  # profile --compare with and without it for fast and exactloop (Ouro-1.4B batch 1, prompt 512), its R0
  # claim at real shape (diff), then bench fast vs fast+pdl at the Ouro C = 1, 8 cells.
  timeout 170 python3 -m pytest -n 0 -m gpu tests/engine/test_pdl.py tests/engine/test_gemv_kernel.py \
    tests/engine/test_paged_attention_kernel.py tests/engine/test_gpu_graphs.py -p no:cacheprovider --tb=short 2>&1 \
    | tail -30 > "$OUT/gpu_tests_pdl_h200.txt"; tail -3 "$OUT/gpu_tests_pdl_h200.txt"
  timeout 120 python3 bench/pdl_h200.py --rows 1,8 --rounds 5 --out "$OUT" >> "$LOG" 2>&1
  echo "pdl bench exit $?"; cat "$OUT/pdl_h200.md"; rm -f "$OUT/pdl_h200.json"
  for r in fast exactloop; do
    timeout -s INT 75 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare $r $r \
      --b-set kernels.pdl=true -o "$OUT/profile_compare_${r}_pdl_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
    echo "profile $r exit $?"; grep -A5 "GPU busy vs idle" "$OUT/profile_compare_${r}_pdl_ouro-1.4b_c1_p512.txt"
  done
  timeout -s INT 60 python3 -m looptrace diff fast --b-set kernels.pdl=true --model ouro-1.4b --device cuda -c 4 \
    --prompt-len 128 --max-tokens 16 --format json -o "$OUT/diff_fast_pdl_ouro-1.4b_c4_h200.json" 2>> "$LOG"
  echo "diff pdl exit $?"
  timeout -s INT "${BENCH_TIMEOUT:-90}" python3 -m looptrace bench --a fast --b fast --b-set kernels.pdl=true \
    --cell ouro:512/128@1,8 --runs 3 --set cuda_graphs.max_graphs=64 --format json \
    -o "$OUT/bench_fast_pdl_ouro.json" 2>> "$LOG"
  echo "bench pdl exit $?"; grep "B/A" "$LOG" | tail -3
fi
if [ "$1" = fast_pdl ]; then
  # fast with kernels.pdl (no GEMV prefetch): the GPU tests, the token bench at 1 row, profile --compare
  # exactloop fast and fast without/with PDL (Ouro-1.4B batch 1, prompt 512), diff exactloop fast at real
  # shape, bench exactloop vs fast at the Ouro C = 1, 8, 32 cells.
  timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_pdl.py tests/engine/test_gpu_graphs.py \
    -p no:cacheprovider --tb=short 2>&1 | tail -12 > "$OUT/gpu_tests_fast_pdl_h200.txt"
  tail -3 "$OUT/gpu_tests_fast_pdl_h200.txt"
  timeout 60 python3 bench/pdl_h200.py --rows 1 --rounds 5 --out "$OUT" >> "$LOG" 2>&1
  echo "pdl bench exit $?"; tail -6 "$OUT/pdl_h200.md"; rm -f "$OUT/pdl_h200.json"
  timeout -s INT 75 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare exactloop fast \
    -o "$OUT/profile_compare_exactloop_fast_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  timeout -s INT 75 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast \
    --a-set kernels.pdl=false -o "$OUT/profile_compare_fast_nopdl_pdl_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
  echo "profile exit $?"; grep -h -A6 "Decode window, per output token: GPU busy" "$OUT"/profile_compare_*.txt
  timeout -s INT 60 python3 -m looptrace diff exactloop fast --model ouro-1.4b --device cuda -c 4 --prompt-len 128 \
    --max-tokens 16 --format json -o "$OUT/diff_exactloop_fast_ouro-1.4b_c4_h200.json" 2>> "$LOG"
  echo "diff exit $?"
  timeout -s INT "${BENCH_TIMEOUT:-150}" python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 \
    --runs 3 --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG" | tail -3
fi
if [ "$1" = fused ]; then
  # The GEMV's fused input forms (R0 over fast without them): their GPU tests with the exact kernels they
  # replay, profile --compare fast without/with them (Ouro-1.4B batch 1, prompt 512), their R0 claim at
  # real shape (diff, batched and solo).
  timeout 200 python3 -m pytest -n 0 -m gpu tests/engine/test_gemv_fused_inputs.py tests/engine/test_gpu_kernels.py \
    tests/engine/test_fused_tails.py tests/engine/test_gemv_kernel.py -p no:cacheprovider --tb=short 2>&1 \
    | tail -30 > "$OUT/gpu_tests_fused_inputs_h200.txt"; tail -3 "$OUT/gpu_tests_fused_inputs_h200.txt"
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast \
    --a-set kernels.gemv_silu=false --a-set kernels.gemv_norm=false \
    -o "$OUT/profile_compare_fast_unfused_fused_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  grep -h -A6 "Decode window, per output token: GPU busy" "$OUT"/profile_compare_*.txt
  timeout -s INT 80 python3 -m looptrace diff fast --b-set kernels.gemv_silu=false --b-set kernels.gemv_norm=false \
    --model ouro-1.4b --device cuda -c 4 --prompt-len 128 --max-tokens 16 --format json \
    -o "$OUT/diff_fast_fused_inputs_ouro-1.4b_c4_h200.json" 2>> "$LOG"; echo "diff exit $?"
fi
if [ "$1" = fused_pick ]; then
  # After `fused` (both forms on: slower): kernels.gemv_silu alone against fast without either; then
  # exactloop vs fast with whichever of the two arms was faster (B_SETS), profile and bench.
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast \
    --a-set kernels.gemv_silu=false --a-set kernels.gemv_norm=false --b-set kernels.gemv_norm=false \
    -o "$OUT/profile_compare_fast_unfused_silu_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  walls=$(grep -A6 "Decode window, per output token: GPU busy" "$OUT/profile_compare_fast_unfused_silu_ouro-1.4b_c1_p512.txt" \
    | grep "│ fast" | awk -F'│' '{gsub(/ /, "", $3); print $3}' | tr '\n' ' ')
  echo "walls (unfused, silu): $walls" | tee -a "$LOG"
  B_SETS="--b-set kernels.gemv_norm=false"
  if python3 -c "import sys; a, b = map(float, sys.argv[1:3]); sys.exit(0 if b < a else 1)" $walls; then
    echo "pick: fast + gemv_silu (no gemv_norm)" | tee -a "$LOG"
  else
    B_SETS="--b-set kernels.gemv_norm=false --b-set kernels.gemv_silu=false"
    echo "pick: fast without either" | tee -a "$LOG"
  fi
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare exactloop fast \
    $B_SETS -o "$OUT/profile_compare_exactloop_fast_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  grep -h -A6 "Decode window, per output token: GPU busy" "$OUT/profile_compare_exactloop_fast_ouro-1.4b_c1_p512.txt"
  timeout -s INT "${BENCH_TIMEOUT:-200}" python3 -m looptrace bench --a exactloop --b fast $B_SETS \
    --cell ouro:512/128@1,8,32 --runs 3 --set cuda_graphs.max_graphs=64 --format json \
    -o "$OUT/bench_exactloop_fast_ouro.json" 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG" | tail -3
fi
if [ "$1" = preload ]; then
  # kernels.gemv_preload (R0): the synthetic token with and without it, profile --compare fast without/with
  # it (Ouro-1.4B batch 1, prompt 512), its R0 claim at real shape (diff), the GPU tests it touches.
  timeout 80 python3 bench/pdl_h200.py --rows 1 --rounds 5 --out "$OUT" >> "$LOG" 2>&1
  echo "pdl bench exit $?"; tail -8 "$OUT/pdl_h200.md"; rm -f "$OUT/pdl_h200.json"
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast \
    --b-set kernels.gemv_preload=true -o "$OUT/profile_compare_fast_preload_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
  echo "profile exit $?"; grep -h -A6 "Decode window, per output token: GPU busy" "$OUT"/profile_compare_*.txt
  timeout -s INT 80 python3 -m looptrace diff fast --b-set kernels.gemv_preload=true --model ouro-1.4b --device cuda \
    -c 4 --prompt-len 128 --max-tokens 16 --format json -o "$OUT/diff_fast_preload_ouro-1.4b_c4_h200.json" \
    > /dev/null 2>> "$LOG"; echo "diff exit $?"; grep -A3 '"summary"' "$OUT/diff_fast_preload_ouro-1.4b_c4_h200.json"
  timeout 200 python3 -m pytest -n 0 -m gpu tests/engine/test_pdl.py tests/engine/test_gemv_kernel.py \
    tests/engine/test_gemv_fused_inputs.py -p no:cacheprovider --tb=short 2>&1 | tail -20 \
    > "$OUT/gpu_tests_preload_h200.txt"; tail -3 "$OUT/gpu_tests_preload_h200.txt"
fi
if [ "$1" = spikes ]; then
  # Single bench rounds with a TTFT far above the others: Triton compilations, GC pauses, rounds.
  timeout -s INT 200 python3 bench/ttft_spikes_h200.py --out "$OUT" -- --a exactloop --b fast \
    --cell ouro:512/128@1,32 --runs 4 --set cuda_graphs.max_graphs=64 --format json \
    -o "$OUT/bench_spikes_exactloop_fast_ouro.json" >> "$LOG" 2>&1; echo "spikes exit $?"; cat "$OUT/ttft_spikes.md"
fi
if [ "$1" = fast_cells ]; then
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast \
    --a-set kernels.gemv_preload=false -o "$OUT/profile_compare_fast_nopreload_preload_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
  echo "profile exit $?"
  profile_exactloop_fast
  timeout -s INT "${BENCH_TIMEOUT:-200}" python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 \
    --runs 3 --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG" | tail -3
fi
tail -5 "$LOG"
if [ "$1" = attn_diag ]; then
  timeout 120 python3 bench/attention_diag_h200.py floors --out "$OUT" >> "$LOG" 2>&1; echo "floors exit $?"
  cat "$OUT/attention_floors_h200.md"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  timeout 240 "$NCU" --clock-control none --kernel-name _attn_kernel --launch-count 12 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 bench/attention_diag_h200.py ncu > "$OUT/ncu_attention_h200.txt" 2>&1; echo "ncu exit $?"
  grep -E "segments|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Warp Cycles Per Issued|Stall" "$OUT/ncu_attention_h200.txt" | head -150
fi
if [ "$1" = slots_sweep ]; then
  timeout 200 python3 bench/decode_attention_h200.py --sweep --sweep-set slots --budget-s 170 --out "$OUT" >> "$LOG" 2>&1
  echo "sweep exit $?"; cat "$OUT/attention_sweep_slots_h200.md"
  python3 -c "import json; r=json.load(open('$OUT/attention_sweep_slots_h200.json')); print('max abs vs default', max(x.get('max_abs_vs_default', 0) for x in r), [x['error'] for x in r if 'error' in x][:3])"
fi
if [ "$1" = ablation ]; then
  timeout 240 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" >> "$LOG" 2>&1; echo "ablation exit $?"
  cat "$OUT/token_ablation_h200.md"
  timeout 90 python3 bench/attention_diag_h200.py floors --out "$OUT" >> "$LOG" 2>&1; echo "floors exit $?"
  cat "$OUT/attention_floors_h200.md"
fi
if [ "$1" = early ]; then
  timeout 300 python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py tests/engine/test_pdl.py \
    tests/engine/test_gemv_kernel.py tests/engine/test_gemv_fused_inputs.py -p no:cacheprovider --tb=short 2>&1 \
    | tail -40 > "$OUT/gpu_tests_early_h200.txt"; tail -5 "$OUT/gpu_tests_early_h200.txt"
  timeout 200 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" >> "$LOG" 2>&1; echo "ablation exit $?"
  cat "$OUT/token_ablation_h200.md"
fi
if [ "$1" = slots ]; then
  timeout 130 python3 bench/decode_attention_h200.py --sweep --sweep-set slots --budget-s 100 --out "$OUT" >> "$LOG" 2>&1
  echo "sweep exit $?"; cat "$OUT/attention_sweep_slots_h200.md"; rm -f "$OUT/attention_sweep_slots_h200.json"
  timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py tests/engine/test_pdl.py \
    -p no:cacheprovider --tb=short 2>&1 | tail -15 > "$OUT/gpu_tests_slots_h200.txt"; tail -3 "$OUT/gpu_tests_slots_h200.txt"
  timeout 120 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast,fast attn-pf,fast slots,fast slots attn-pf,exact,exact slots,exact+pdl,exact+pdl slots attn-pf" >> "$LOG" 2>&1
  echo "ablation exit $?"; cat "$OUT/token_ablation_h200.md"
fi
if [ "$1" = engine5 ]; then
  profile_exactloop_fast
  timeout -s INT 70 python3 -m looptrace diff exactloop fast --model ouro-1.4b --device cuda -c 4 --prompt-len 128 \
    --max-tokens 16 --format json -o "$OUT/diff_exactloop_fast_ouro-1.4b_c4_h200.json" > /dev/null 2>> "$LOG"
  echo "diff fast exit $?"; grep -A3 '"summary"' "$OUT/diff_exactloop_fast_ouro-1.4b_c4_h200.json" | head -8
  timeout -s INT 60 python3 -m looptrace diff fast --b-set kernels.attn_prefetch=false --model ouro-1.4b --device cuda \
    -c 4 --prompt-len 128 --max-tokens 16 --format json -o "$OUT/diff_fast_attn_prefetch_ouro-1.4b_c4_h200.json" \
    > /dev/null 2>> "$LOG"; echo "diff prefetch exit $?"
  timeout -s INT 70 python3 -m looptrace diff exactloop fast --model ouro-tiny --device cuda --format json \
    -o "$OUT/diff_exactloop_fast_ouro-tiny_h200.json" > /dev/null 2>> "$LOG"; echo "diff tiny fast exit $?"
  for m in ouro-tiny huginn-tiny; do
    timeout -s INT 60 python3 -m looptrace diff base exactloop --model $m --device cuda 2>&1 | tail -3 | tee -a "$LOG"
  done
  timeout 60 python3 bench/decode_attention_h200.py --old bench/paged_attention_2e6f966.py --out "$OUT" >> "$LOG" 2>&1
  echo "attention exit $?"; rm -f "$OUT/decode_attention_h200.json"; cat "$OUT/decode_attention_h200.md"
  timeout -s INT "${BENCH_TIMEOUT:-200}" python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 \
    --runs 3 --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG" | tail -3
fi
if [ "$1" = final5 ]; then
  timeout 120 python3 -m pytest -n 0 -m gpu tests/engine/test_paged_attention_kernel.py -p no:cacheprovider \
    --tb=short 2>&1 | tail -15 > "$OUT/gpu_tests_final5_h200.txt"; tail -2 "$OUT/gpu_tests_final5_h200.txt"
  timeout 60 python3 bench/decode_attention_h200.py --old bench/paged_attention_2e6f966.py --out "$OUT" >> "$LOG" 2>&1
  echo "attention exit $?"; rm -f "$OUT/decode_attention_h200.json"; cat "$OUT/decode_attention_h200.md"
  timeout -s INT "${BENCH_TIMEOUT:-190}" python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 \
    --runs 3 --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" > /dev/null 2>> "$LOG"
  echo "bench exit $?"; grep "B/A" "$LOG" | tail -3
fi
if [ "$1" = outforms ]; then
  timeout 200 python3 -m pytest -n 0 -m gpu tests/engine/test_gemv_fused_outputs.py tests/engine/test_gemv_fused_inputs.py \
    tests/engine/test_pdl.py tests/engine/test_gpu_kernels.py tests/engine/test_fused_tails.py -p no:cacheprovider 2>&1 \
    | tail -25 > "$OUT/gpu_tests_outforms_h200.txt"; tail -4 "$OUT/gpu_tests_outforms_h200.txt"
  timeout 120 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast slots attn-pf,\
fast slots attn-pf silu-out,fast slots attn-pf norm-out,fast slots attn-pf silu-out norm-out" >> "$LOG" 2>&1
  echo "token exit $?"; tail -6 "$OUT/token_ablation_h200.md"
  timeout 170 python3 bench/token_ablation_h200.py --gemv-sweep --rounds 3 --out "$OUT" >> "$LOG" 2>&1
  echo "sweep exit $?"; sort -t'|' -k3 -n "$OUT/gemv_sweep_h200.md" | head -14
  OFF="--a-set kernels.gemv_silu_out=false --a-set kernels.gemv_norm_out=false"
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast $OFF \
    -o "$OUT/profile_compare_fast_outforms_ouro-1.4b_c1_p512.txt" 2>> "$LOG"; echo "profile exit $?"
  grep -h -A6 "Decode window, per output token: GPU busy" "$OUT"/profile_compare_*.txt
  diff_real fast_outforms fast --b-set kernels.gemv_silu_out=false --b-set kernels.gemv_norm_out=false
fi
if [ "$1" = onepass ]; then
  timeout 200 python3 -m pytest -n 0 -m gpu tests/engine/test_gemv_fused_outputs.py tests/engine/test_gemv_fused_inputs.py \
    tests/engine/test_pdl.py tests/engine/test_gpu_kernels.py tests/engine/test_fused_tails.py -p no:cacheprovider 2>&1 \
    | tail -80 > "$OUT/gpu_tests_onepass_h200.txt"; tail -6 "$OUT/gpu_tests_onepass_h200.txt"
  timeout 150 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast slots attn-pf,\
fast slots attn-pf steps,fast slots attn-pf silu-out,fast slots attn-pf silu-out tuned,\
fast slots attn-pf silu-out norm-out,exact steps,exact" >> "$LOG" 2>&1
  echo "token exit $?"; tail -9 "$OUT/token_ablation_h200.md"
  timeout 60 python3 bench/token_ablation_h200.py --gemv-sweep --rounds 7 --only "gemv-only,gemv-only tuned" \
    --out "$OUT" >> "$LOG" 2>&1; echo "sweep exit $?"; tail -3 "$OUT/gemv_sweep_h200.md"
  profile_exactloop_fast
fi
if [ "$1" = final6 ]; then
  timeout 170 python3 -m pytest -n 0 -m gpu tests/engine/test_gemv_kernel.py tests/engine/test_gemv_fused_outputs.py \
    tests/engine/test_pdl.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests_final6_h200.txt"
  tail -4 "$OUT/gpu_tests_final6_h200.txt"
  timeout 100 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast slots attn-pf steps,\
fast slots attn-pf silu-out s5-tiles,fast slots attn-pf silu-out,exact steps,exact" >> "$LOG" 2>&1
  echo "token exit $?"; tail -7 "$OUT/token_ablation_h200.md"
  profile_exactloop_fast
  diff_real exactloop_fast exactloop fast
  diff_real fast_silu_out fast --b-set kernels.gemv_silu_out=false
  timeout -s INT 300 python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 --runs 3 \
    --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" >> "$LOG" 2>&1
  echo "bench exit $?"; grep -i "B/A\|tok/s" "$LOG" | tail -8
fi
if [ "$1" = explore7 ]; then
  timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_pdl.py -k "chain" -p no:cacheprovider 2>&1 \
    | tail -30 > "$OUT/gpu_tests_explore7_h200.txt"; tail -3 "$OUT/gpu_tests_explore7_h200.txt"
  timeout 150 python3 bench/token_ablation_h200.py --rounds 3 --gemv-sweep7 --out "$OUT" >> "$LOG" 2>&1
  echo "sweep exit $?"; tail -36 "$OUT/gemv_sweep7_h200.md"
  timeout 150 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast6,fast6 pf1,fast6 pf1 no-down,\
fast7,fast6 pf2,fast6 pf2 no-down,fast6 pf4,fast6 pf4 no-down,fast6 o+down 4x512 w2 k1,fast6 o+down 8x256 w2 k1,\
fast6 o+down 8x256 w4 k2,exact" >> "$LOG" 2>&1
  echo "token exit $?"; tail -13 "$OUT/token_ablation_h200.md"
fi
if [ "$1" = final7 ]; then
  timeout 200 python3 -m pytest -n 0 -m gpu tests/engine/test_pdl.py tests/engine/test_gemv_kernel.py \
    tests/engine/test_gemv_fused_outputs.py -p no:cacheprovider 2>&1 | tail -30 > "$OUT/gpu_tests_final7_h200.txt"
  tail -3 "$OUT/gpu_tests_final7_h200.txt"
  timeout 100 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast6,fast7,exact" >> "$LOG" 2>&1
  echo "token exit $?"; tail -4 "$OUT/token_ablation_h200.md"
  profile_compare exactloop fast
  profile_compare base exactloop
  diff_real exactloop_fast exactloop fast
  diff_real fast_preload fast --b-set kernels.gemv_preload=false
fi
if [ "$1" = cells7 ]; then
  timeout -s INT 300 python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 --runs 3 \
    --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro.json" >> "$LOG" 2>&1
  echo "bench exit $?"; grep -i "B/A\|tok/s" "$LOG" | tail -8
  timeout -s INT 200 python3 -m looptrace bench --cell huginn:512/64@32 --runs 3 --set cuda_graphs.max_graphs=64 \
    --format json -o "$OUT/bench_huginn_512_64_32.json" >> "$LOG" 2>&1
  echo "huginn bench exit $?"; grep -i "B/A\|tok/s" "$LOG" | tail -4
fi
if [ "$1" = quick7 ]; then
  timeout 120 python3 -m pytest -n 0 -m gpu tests/engine/test_pdl.py -k "chain" -p no:cacheprovider 2>&1 \
    | tail -30 > "$OUT/gpu_tests_quick7_h200.txt"; tail -3 "$OUT/gpu_tests_quick7_h200.txt"
  timeout 150 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast6,fast6 pf1,fast6 pf1 no-down,\
fast6 pf2,fast6 pf2 no-down,fast6 pf4,fast6 o+down 4x512 w2 k1,fast6 o+down 8x256 w2 k1,fast6 o+down 8x256 w4 k2,exact" \
    >> "$LOG" 2>&1
  echo "token exit $?"; tail -12 "$OUT/token_ablation_h200.md"
  profile_compare exactloop fast
fi
if [ "$1" = card8 ]; then
  timeout 330 python3 -m pytest -n 4 -m gpu tests -p no:cacheprovider --durations=5 2>&1 | tail -40 \
    > "$OUT/gpu_tests_all_${CARD:-gpu}.txt"; tail -3 "$OUT/gpu_tests_all_${CARD:-gpu}.txt"
  timeout 90 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast6,fast7,exact" >> "$LOG" 2>&1
  echo "token exit $?"; tail -4 "$OUT/token_ablation_h200.md"; grep -o 'at [0-9.]* TB/s' "$OUT/token_ablation_h200.md"
  profile_compare base exactloop
  diff_real exactloop_fast exactloop fast
fi
if [ "$1" = h200_8 ]; then
  timeout 90 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast6,fast6 rope,fast6 rope-out,\
exact rope" >> "$LOG" 2>&1
  echo "token exit $?"; tail -6 "$OUT/token_ablation_h200.md"; grep -o 'at [0-9.]* TB/s' "$OUT/token_ablation_h200.md"
  profile_compare exactloop fast
  profile_compare base exactloop
  timeout -s INT 190 python3 -m looptrace bench --cell huginn:512/64@32 --runs 3 --set cuda_graphs.max_graphs=64 \
    --format json -o "$OUT/bench_huginn_512_64_32.json" >> "$LOG" 2>&1
  echo "huginn bench exit $?"; grep -i "B/A" "$LOG" | tail -2
fi
if [ "$1" = rope9 ]; then
  timeout 150 python3 -m pytest -n 0 -m gpu tests/engine/test_gemv_rope.py tests/engine/test_pdl.py -k "rope or chain" \
    -p no:cacheprovider 2>&1 | tail -30 > "$OUT/gpu_tests_rope9_${CARD:-gpu}.txt"; tail -3 "$OUT/gpu_tests_rope9_${CARD:-gpu}.txt"
  timeout 110 python3 bench/token_ablation_h200.py --rounds 7 --out "$OUT" --only "fast6,fast6 rope,fast6 rope-out,\
exact rope" >> "$LOG" 2>&1
  echo "token exit $?"; tail -5 "$OUT/token_ablation_h200.md"; grep -o 'at [0-9.]* TB/s' "$OUT/token_ablation_h200.md"
  timeout -s INT 90 python3 -m looptrace profile --model ouro -c 1 --prompt-len 512 --compare fast fast \
    --b-set kernels.gemv_rope_out=true -o "$OUT/profile_compare_fast_rope_out_ouro-1.4b_c1_p512.txt" 2>> "$LOG"
  echo "profile fast rope_out exit $?"
  grep -h -A6 "Decode window, per output token: GPU busy" "$OUT/profile_compare_fast_rope_out_ouro-1.4b_c1_p512.txt"
  diff_real fast_rope_out fast --b-set kernels.gemv_rope_out=true
  timeout -s INT 120 python3 -m looptrace bench --a fast --b fast --b-set kernels.gemv_rope_out=true \
    --cell ouro:512/128@1 --runs 3 --set cuda_graphs.max_graphs=64 --format json \
    -o "$OUT/bench_fast_rope_out_ouro.json" >> "$LOG" 2>&1
  echo "bench exit $?"; grep -i "B/A\|tok/s" "$LOG" | tail -4
fi
if [ "$1" = card11 ]; then
  timeout 90 python3 bench/token_ablation_h200.py --rounds 5 --out "$OUT" --only "fast6 rope,fast6 rope-out,\
exact rope" >> "$LOG" 2>&1
  echo "token exit $?"; tail -5 "$OUT/token_ablation_h200.md"; grep -o 'at [0-9.]* TB/s' "$OUT/token_ablation_h200.md"
  profile_compare exactloop fast
  [ "${CARD:-}" = h200 ] && profile_compare base exactloop
  timeout -s INT 300 python3 -m looptrace bench --a exactloop --b fast --cell ouro:512/128@1,8,32 --runs 3 \
    --set cuda_graphs.max_graphs=64 --format json -o "$OUT/bench_exactloop_fast_ouro_${CARD:-gpu}.json" >> "$LOG" 2>&1
  echo "bench exit $?"; grep -i "B/A\|tok/s" "$LOG" | tail -8
  timeout -s INT 80 python3 -m looptrace diff exactloop fast --model ouro-tiny --device cuda --format json \
    -o "$OUT/diff_exactloop_fast_ouro-tiny_${CARD:-gpu}.json" > /dev/null 2>> "$LOG"
  echo "diff tiny exit $?"; grep -A4 '"summary"' "$OUT/diff_exactloop_fast_ouro-tiny_${CARD:-gpu}.json" | head -8
fi
