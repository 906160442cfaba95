"""The wrapped model: a model as a pure function of (tokens, state).

wrap           wrap(model): picks the mlx-lm or the mlx-vlm wrapped model
model          WrappedModel (mlx-lm models)
vlm            VLMWrappedModel (mlx-vlm models; imports mlx_vlm)
chain          WrappedModel.chain: a draft model's steps on its own caches
forward        one forward over a state (the one place a model runs); replayed checkpoints
prefill        a prompt's forward in chunks, the logits of its last position only
tree_forward   a token tree's forward (with `instruments.tree`)
tokens         token id checks, the vocabulary guard and NaN poisoning
fit            does a state fit a model
kept_caches    the last plain forward's caches, kept for the next
placement      which part of a distributed model this process runs
options        what a model decides when it is wrapped; `wrap_options`
"""
