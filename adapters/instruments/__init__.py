"""Instruments for one forward: library code run as written, with instance surgery
(`swap`) for the length of that forward only.

    swap       an object's class swapped for one forward, the subclasses made once
    capture    recurrent checkpoints recorded inside the mixers kvstate knows
    hidden     the final hidden states, recorded at the output projection
    routing    attention routed to kvstate's own (quantized caches; the verify kernel)
    buckets    a multi-token forward's key length bucketed on CUDA
    tree       a token tree's positions, masks and recurrences
"""
