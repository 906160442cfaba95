"""Commit one root-to-node path of a tree forward (`Target.tree_forward`).

A tree forward appended its T tokens to every layer in input order (each token attending to
its ancestors only), and left each recurrent layer in the state after its last input.
Keeping the path at input positions `kept` (0 first, increasing) is a generic of the kind
contract, `kvstate.kinds.keep_path`, registered by each kind that can (dense KV and unpadded
sliding windows gather the path's entries into place, `gather_path`; recurrent layers take
the checkpoint after the path's last position): a new kind works in tree verification by
registering it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import CommitError
from .. import eval as evaluate
from ..kinds import appended_of, gather_path, keep_path


def commit_path(state: Any, kept: Sequence[int], checkpoints: Any) -> Any:
    """`state` (batch 1, after a tree forward) keeping only input positions `kept`."""
    kept = tuple(kept)
    appended = appended_of(state)
    if kept[-1] >= appended:
        raise CommitError(
            f"tree commit: positions {list(kept)} reach past the {appended} tokens the last "
            "forward appended; pass the state the tree forward returned"
        )
    gathered = None
    if list(kept) != list(range(len(kept))):  # the path is not already in place
        gathered = gather_path(state, kept)
        # Evaluate the small gathered blocks first, all layers in one sync: with a gather
        # still pending MLX cannot write into the buffer in place and would copy the whole
        # context.
        evaluate(gathered)
    return keep_path(state, kept, checkpoints, gathered)
