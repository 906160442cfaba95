#!/usr/bin/env bash
# The H200 session: GPU checks and benchmarks in two 10-minute device calls, each printing
# (and saving under $OUT) every row as it is measured. See BENCHMARKS.md for the recipe that
# brings MLX CUDA onto the device (.whl/a, .whl/b); `.whl/t` holds pytest / hypothesis wheels
# and `.whl/src.tar` a `git archive HEAD` of this repository.
#
#   bash benchmarks/h200.sh tests quantized decode     (one call)
#   bash benchmarks/h200.sh spec drafters              (the next)
#   SEEDS=1,2 bash benchmarks/h200.sh drafters         (seeds of the draft-model generator rows)
#   KVSTATE_MODEL_CACHE=/path/to/models bash benchmarks/h200.sh real-speed   (the real models)
#   KVSTATE_MODEL_CACHE=/path/to/models bash benchmarks/h200.sh engine-rounds policy-smollm (issues 23, 24)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d /tmp/src/kvstate/adapters ]; then  # kvstate.adapters lives in adapters/: as installed
  mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src
  cp -r /tmp/src/adapters /tmp/src/kvstate/adapters
fi
export PYTHONPATH=/tmp/site:/tmp/src:/tmp/src/benchmarks PYTHONUNBUFFERED=1
cd /tmp/src
step() {  # step SECONDS NAME COMMAND...: one part, cut at its own limit, logged as it runs
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
}
for part in "$@"; do
case "$part" in
  tests)
    # float32 matmuls in full precision: the tests compare forwards of different shapes
    step 300 gpu-tests env MLX_ENABLE_TF32=0 HYPOTHESIS_PROFILE=ci python3 -m pytest -q -p no:cacheprovider \
      tests/test_chain.py tests/test_kept_caches.py tests/test_buckets.py tests/test_quantized_options.py \
      tests/test_quantized_speculative.py tests/test_model_drafter.py tests/test_tree_verify.py \
      tests/test_hybrid_models.py property_tests/test_gated_delta_steps.py \
      tests/test_speculative_tree.py tests/test_tree_sampling.py tests/test_model_drafter_tree.py
    ;;
  quantized)
    step 70 qattn-probe python3 benchmarks/probes/cuda_qattn_probe.py
    step 90 quantized-decode python3 benchmarks/quantized_quality.py --parts decode
    ;;
  decode)
    step 150 decode python3 benchmarks/verify.py --only decode
    ;;
  matmul-launch)  # a verify's matmuls: host launch per matmul by rows (gemv vs GEMM, 4-bit)
    step 120 matmul-launch python3 benchmarks/probes/matmul_launch.py
    ;;
  launch)  # a verify forward's host time by attention path (buckets, cuDNN, the verify kernel)
    step 200 verify-launch python3 benchmarks/probes/verify_launch.py
    ;;
  kernel-tests)  # the verify kernel and what routes to it
    step 200 kernel-tests env MLX_ENABLE_TF32=0 HYPOTHESIS_PROFILE=ci python3 -m pytest -q -p no:cacheprovider \
      tests/test_buckets.py tests/test_chain.py tests/test_kept_caches.py tests/test_speculative.py
    ;;
  sampled-300)  # the 300-row sampled generation test, with and without bucketing (a CUDA graph error)
    for force in None False; do
      step 60 "sampled-300-force-$force" env MLX_ENABLE_TF32=0 python3 -c "import sys, pytest
from kvstate.adapters import wrap_options
with wrap_options(buckets=$force):
  sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-x',
    'tests/test_speculative.py::test_sampled_generation_matches_the_target_distribution']))"
    done
    ;;
  plain-tests)  # pipelined plain decoding, hundreds of prompts (one graph of prefills failed on CUDA)
    step 200 plain-tests env MLX_ENABLE_TF32=0 HYPOTHESIS_PROFILE=ci python3 -m pytest -q -p no:cacheprovider \
      tests/test_plain_generate.py \
      tests/test_speculative.py::test_sampled_generation_matches_the_target_distribution
    ;;
  overhead)
    step 90 decode-overhead python3 benchmarks/probes/decode_overhead.py --reps 40
    ;;
  spec)
    step 240 spec python3 benchmarks/verify.py --only spec --models llama qwen3_next
    ;;
  spec-llama)  # p = 0.8 rows with 400 tokens a run: ~120 rounds, the realized acceptance near the law's
    step 200 spec-llama python3 benchmarks/verify.py --only spec decode --models llama --ps 0.8 --ks 2 4 8 \
      --tokens 400
    ;;
  spec-all)  # decode (per-step wrap and m.chain blocks) and p = 0.8, K = 4 on all three models
    step 400 spec-all python3 benchmarks/verify.py --only decode spec --models llama qwen3_next nemotron_h \
      --ps 0.8 --ks 4 --tokens 400
    ;;
  drafters)
    step 240 speculative env MLX_ENABLE_TF32=0 python3 benchmarks/speculative.py --sizes large --ks 4 --reps 3 \
      --seeds "${SEEDS:-0}"
    ;;
  trees)
    step 300 trees env MLX_ENABLE_TF32=0 python3 benchmarks/tree_generate.py --size large \
      --models "${MODELS:-llama,qwen3_next}" --reps 3
    ;;
  real-speed)  # the packaged real models (KVSTATE_MODEL_CACHE: their converted folders), bf16, ~4 min
    step 280 real-speed python3 benchmarks/real_speed.py ${REAL_SPEED_ARGS:-}
    ;;
  engine-rounds)  # issue 23: the engine's n-gram rows under a steady load, rounds by the policy's reason
    for kind in ${KINDS:-code prose chat}; do
      step 300 "engine-rounds-$kind" python3 benchmarks/probes/engine_rounds.py --queue 4 --kinds "$kind" \
        --reps 2 --no-profile --only "engine plain" "engine ngram" "engine ngram k=4"
    done
    ;;
  policy-smollm)  # issue 24: the default policy against every fixed k on SmolLM2's three prompts
    step 400 policy-smollm python3 benchmarks/policy.py --parts smollm --reps 2
    ;;
  policy-rounds)  # issue 24: one SmolLM2 row's rounds by kind and their times (where the policy loses)
    step 200 policy-rounds python3 benchmarks/probes/policy_rounds.py --smollm code,prose,chat \
      --tokens 200 --trace
    ;;
  policy-hybrid)  # issue 24: the oracle hybrid at p = 0.2 .. 0.95 (float32: TF32 off)
    step 400 policy-hybrid env MLX_ENABLE_TF32=0 python3 benchmarks/policy.py --size large --parts hybrid \
      --hybrid-tokens 160 --hybrid-reps 2
    ;;
  ragged-reference)  # the kernel and cuDNN routes' bf16 logits against SmolLM2 in float32
    step 200 ragged-reference env MLX_ENABLE_TF32=0 python3 benchmarks/probes/ragged_verify_kernel.py \
      --rows 2 8 --widths 3 5 --reps 3 --reference float32 --no-kernel-check
    ;;
  *) echo "usage: bash benchmarks/h200.sh [tests] [quantized] [decode] [overhead] [spec] [spec-llama] [drafters] [trees] [launch] [kernel-tests] [sampled-300] [spec-all] [plain-tests] [real-speed] [engine-rounds] [policy-smollm] [policy-rounds] [policy-hybrid] [ragged-reference]"; exit 2 ;;
esac
done
