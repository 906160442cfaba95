#!/usr/bin/env bash
# The 2-GPU session (issue 25): a model split over two H200s of one host, one process per
# GPU over NCCL (`mlx.launch --backend nccl -n 2` sets CUDA_VISIBLE_DEVICES per rank). One
# device call on the `nvidia-h200-x2` kind, after MLX CUDA is in /tmp/site as for
# benchmarks/h200.sh (/work/shared/gpu/prepare-mlx-cuda-wheels.sh: .whl/a, then .whl/b;
# `.whl/t` the pytest / hypothesis wheels; `.whl/src.tar` a `git archive HEAD`). Every part
# prints its rows as measured and saves its log under $OUT.
#
#   bash benchmarks/h200x2.sh                 # check tests speed decode (expected ~5 min)
#   bash benchmarks/h200x2.sh speed decode    # some parts (a second call, if the first is cut)
#
#   check   the GPUs, NCCL's availability in MLX, one all_sum over the two GPUs
#   tests   tests/test_distributed.py over nccl: wrap, the generator and the engine on the
#           sharded llama / qwen3_5-style and pipelined qwen3_next-style tiny models (float32)
#           give the single-GPU model's tokens, identical rounds on both ranks, per-rank
#           save / load, gather into the single-GPU state, DivergenceError
#   agree   agree's cost per call over NCCL (median us of 2000 calls) and the raw
#           all_gather of 3 int32 it is made of (speed measures it too, 1000 calls)
#   speed   agree's cost, then ~1.1B bf16 llama and qwen3_5-style hybrid (tensor parallel) and qwen3_next-style
#           hybrid (pipelined): tokens/s split over 2 GPUs vs one GPU, plain and speculative
#           (oracle drafter p = 0.8, K = 4), time per round and agree's share of it
#   decode  per-token wrap vs raw mlx-lm caches on the split 1.1B llama
#
# The same plumbing on a CPU machine (a smoke run of this script: ring over loopback, tiny
# models; python3 the venv's): PATH=$PWD/.venv/bin:$PATH BACKEND=ring SIZE=tiny TOKENS=24 \
#   bash benchmarks/h200x2.sh tests speed
set -uo pipefail
BACKEND=${BACKEND:-nccl} SIZE=${SIZE:-1b} TOKENS=${TOKENS:-128}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -f .whl/src.tar ] && [ ! -d /tmp/src/kvstate/adapters ]; then  # as installed
  mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src
  cp -r /tmp/src/adapters /tmp/src/kvstate/adapters
fi
if [ -d /tmp/src/kvstate/adapters ]; then
  SRC=/tmp/src && export PYTHONPATH=/tmp/site:$SRC:$SRC/benchmarks
else  # a checkout with kvstate installed (editable): only the benchmarks' helpers on the path
  SRC=$PWD && export PYTHONPATH=/tmp/site:$SRC/benchmarks
fi
export PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH  # mlx.launch, installed with --target /tmp/site
cd "$SRC"
step() {  # step SECONDS NAME COMMAND...: one part, cut at its own limit, logged as it runs
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
}
[ $# -gt 0 ] || set -- check tests speed decode
for part in "$@"; do
case "$part" in
  check)
    step 60 check bash -c 'nvidia-smi -L; python3 -c "import mlx.core as mx; print(\"mlx\", mx.__version__, \"cuda\", mx.cuda.is_available(), \"nccl\", mx.distributed.is_available(\"nccl\"))"
      python3 -c "from mlx._distributed_utils.launch import main; main()" --backend nccl -n 2 python3 -c "
import os, mlx.core as mx
g = mx.distributed.init(strict=True, backend=\"nccl\")
s = mx.distributed.all_sum(mx.ones(4) * (g.rank() + 1), group=g)
print(\"rank\", g.rank(), \"of\", g.size(), mx.default_device(), \"CUDA_VISIBLE_DEVICES\", os.environ.get(\"CUDA_VISIBLE_DEVICES\"), \"all_sum\", s.tolist())"'
    ;;
  tests)
    # float32 matmuls in full precision: the ranks' split sums are compared with one GPU's
    step 240 dist-tests env KVSTATE_DIST_BACKEND=$BACKEND MLX_ENABLE_TF32=0 HYPOTHESIS_PROFILE=ci \
      python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py
    ;;
  agree)
    step 60 dist-agree python3 benchmarks/distributed.py --backend $BACKEND --parts agree --calls 2000
    ;;
  speed)
    step 240 dist-speed python3 benchmarks/distributed.py --backend $BACKEND --size $SIZE \
      --parts agree,speed --calls 1000 --tokens $TOKENS
    ;;
  decode)
    step 90 dist-decode python3 benchmarks/distributed.py --backend $BACKEND --size $SIZE --parts decode
    ;;
  *) echo "usage: bash benchmarks/h200x2.sh [check] [tests] [agree] [speed] [decode]"; exit 2 ;;
esac
done
