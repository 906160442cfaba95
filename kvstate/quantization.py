"""The pieces of a QuantizedKV, for code that writes into one or reads it (adapters,
benchmarks, your own attention): each side's `Codec` (pad, rotate, quantize and back), the
rotations, the codec statics by name (`codec_of`, `CODEC_FIELDS`), and which states mlx-lm's
QuantizedKVCache can hold as they are. For quantized sliding windows (QuantizedRotatingKV):
`lanes` (the state as three RotatingKV windows of packed words, scales and biases) and
`joined` (three lanes back as one state), and `dequantized` (the RotatingKV of its
dequantized values, slot for slot). `latest`: the last n positions of an array (an exact
tail's); `attention_with_raw_keys`: one softmax over quantized and raw keys (a window and its
exact ring)."""

from ._quant_codec import Codec, Quantized, channel_pad, packed_width
from ._quantized import (
    BITS,
    CODEC_FIELDS,
    GROUP_SIZES,
    codec_of,
    is_mlx_lm_form,
    key_codec,
    latest,
    value_codec,
    with_pads,
)
from ._quantized_attention import attention_with_raw_keys
from ._quantized_rotating import dequantized, joined, lanes
from ._rotations import ROTATIONS, rotation_matrix, rotation_numpy

__all__ = [
    "BITS",
    "CODEC_FIELDS",
    "GROUP_SIZES",
    "ROTATIONS",
    "Codec",
    "Quantized",
    "attention_with_raw_keys",
    "channel_pad",
    "codec_of",
    "dequantized",
    "is_mlx_lm_form",
    "joined",
    "key_codec",
    "lanes",
    "latest",
    "packed_width",
    "rotation_matrix",
    "rotation_numpy",
    "value_codec",
    "with_pads",
]
