"""The pieces of a TurboQuantKV, for code that writes into one or reads it (adapters,
benchmarks): the bit widths, how a split side (x.5 bits, mlx-vlm's Split layout) divides its
channels, and the packed index width of each part."""

from ._turboquant import (
    SPLIT_SEED_OFFSET,
    TURBOQUANT_BITS,
    TURBOQUANT_CODECS,
    TURBOQUANT_SPLIT_BITS,
    high_channels,
    index_width,
    is_split,
    low_channels,
    scheme_of,
    split_sizes,
)

__all__ = [
    "SPLIT_SEED_OFFSET",
    "TURBOQUANT_BITS",
    "TURBOQUANT_CODECS",
    "TURBOQUANT_SPLIT_BITS",
    "high_channels",
    "index_width",
    "is_split",
    "low_channels",
    "scheme_of",
    "split_sizes",
]
