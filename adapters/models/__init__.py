"""Models the adapters build: the MTP draft head (`mtp_head`), random-init mlx-lm models for
tests and demos (`tiny`, public as `kvstate.adapters.tiny_models`) and a real small model read
from a GGUF file (`real`, public as `kvstate.adapters.real_models`)."""
