"""Where does SmolLM2 (head dim 64) read text wrongly through quantized states on MLX CUDA?

The previous sessions measured perplexity ~2000 instead of 11 on the H200 for kvstate's K4/V3
and rotated states at head dim 64 (group 64), while `kvstate.quantized_attention` at group 32
agreed with the CPU stream (`cuda_qmm_dim64.py`). This reads the same 512 tokens of English
teacher-forced (chunks of 256) through each option on the device and on the CPU stream, fp32,
and prints both mean NLLs side by side (`--device-only`: the device's alone; `--only=A,B`:
those options); then `mx.quantized_matmul` against dequantize + matmul at head dims 64, 128
and 256 and groups up to the head dim (the suspect: one group per row).

    MLX_ENABLE_TF32=0 KVSTATE_MODEL_CACHE=DIR PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks \
        python3 benchmarks/probes/cuda_quantized_real.py
"""

from __future__ import annotations

import itertools
import math
import sys

import _on_path  # noqa: F401  (benchmarks/ on the path)
import mlx.core as mx
from real_quality import read_text, text_ids, through_state

import kvstate as ks
from kvstate.adapters import load_model, wrap

OPTIONS: dict[str, dict | None] = {
    "dense": None,
    "K4/V3 g64": {"key_bits": 4, "value_bits": 3, "group_size": 64},
    "K4/V3 g32": {"key_bits": 4, "value_bits": 3, "group_size": 32},
    "K4/V3 hadamard g64": {
        "key_bits": 4,
        "value_bits": 3,
        "group_size": 64,
        "rotation": "hadamard",
    },
    "K4/V4 g64": {"bits": 4, "group_size": 64},
    "K4/V4 g32": {"bits": 4, "group_size": 32},
    "K8/V8 g64": {"bits": 8, "group_size": 64},
}


def mean_nll(m, ids, options, chunk=256) -> str:
    state = m.init_state()
    if options is not None:
        state = ks.quantize(state, **options)
    try:
        nll, _ = read_text(through_state(m, state), ids, chunk)
    except (RuntimeError, ValueError) as e:
        return "raises: " + str(e).splitlines()[0][:60]
    return f"{float(nll.mean()):.4f} (ppl {math.exp(float(nll.mean())):.2f})"


def model_part() -> None:
    model, tokenizer = load_model("smollm2-135m")
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    m = wrap(model)
    ids = text_ids(tokenizer, "english", 513)
    print(f"# SmolLM2-135M fp32, {len(ids)} tokens, chunks of 256: mean NLL device | cpu stream")
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    for name, options in OPTIONS.items():
        if only and name not in only[0].split(","):
            continue
        on_device = mean_nll(m, ids, options)
        if "--device-only" in sys.argv:
            print(f"{name:20s} {on_device}", flush=True)
            continue
        with mx.stream(mx.cpu):
            on_cpu = mean_nll(m, ids, options)
        print(f"{name:20s} {on_device:28s} | {on_cpu}", flush=True)


def kernel_part() -> None:
    print("# quantized_matmul vs dequantize+matmul, fp32: dim bits group transpose m n -> err")
    for (dim, group), bits, transpose, (m, n) in itertools.product(
        ((64, 64), (64, 32), (128, 64), (128, 128), (256, 64)),
        (3, 4),
        (True, False),
        ((3, 256), (768, 512)),
    ):
        mx.random.seed(0)
        data = mx.random.normal((1, 3, n, dim))
        w, scales, biases = mx.quantize(data, group_size=group, bits=bits)
        dense = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
        x = mx.random.normal((1, 3, m, dim if transpose else n))
        try:
            got = mx.quantized_matmul(
                x, w, scales, biases, transpose=transpose, group_size=group, bits=bits
            )
            want = x @ (dense.swapaxes(-1, -2) if transpose else dense)
            err = (mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))).item()
            result = f"{err:.2e}"
        except (RuntimeError, ValueError) as e:
            result = "raises: " + str(e).splitlines()[0][:60]
        print(dim, bits, group, transpose, m, n, "->", result, flush=True)


if __name__ == "__main__":
    print(f"# {mx.default_device()}, mlx {mx.__version__}")
    if "--kernels-first" in sys.argv:
        kernel_part()
    model_part()
    if "--kernels-first" not in sys.argv:
        kernel_part()
