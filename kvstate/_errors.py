"""One exception family. Every message says what is wrong, the values involved, and the fix."""

from __future__ import annotations


class StateError(ValueError):
    """Base class of every error kvstate raises on bad input."""


class NotSupportedError(StateError):
    """A well-formed request that this model, cache or kind cannot do (a tree forward over a
    quantized cache, a cache class kvstate does not convert, a mode a drafter lacks): not a
    mistake in the arguments. Raised apart from the other errors so a caller can fall back."""


class CommitError(StateError):
    """`commit_prefix` got counts it cannot honour (too many, negative, not integers)."""


class CheckpointRequiredError(CommitError):
    """A recurrent state cannot be trimmed: rolling it back needs the verify forward's checkpoints."""


class RowError(StateError):
    """Row indices out of range, or of the wrong type."""


class ConfigMismatchError(StateError):
    """States of different kinds or configurations were combined (merge, extend)."""


class ShapeError(StateError):
    """Arrays whose shapes or dtypes do not fit the state they are meant for."""


class TokenError(StateError):
    """Token ids a model cannot take: not integers, an empty batch, or outside the vocabulary."""


class FileFormatError(StateError):
    """A saved state that is truncated, tampered with, or of an unknown version."""


class PlacementError(ConfigMismatchError):
    """A state of one rank or sharding used where another is expected (a rank file loaded by
    the wrong rank or world size, states of different shardings combined)."""


class DivergenceError(StateError):
    """The ranks of a distributed group reached different decisions (accepted counts, rows)."""


def inconsistent(kind: str, found: list[str]) -> ShapeError:
    """The error for a state of class `kind` whose fields disagree (`found`: what
    `kinds.problems` reported, each naming its field), raised by its constructor and by
    `kvstate.check`. Shows the first 20 problems."""
    shown = "; ".join(found[:20]) + (f"; ... ({len(found) - 20} more)" if len(found) > 20 else "")
    return ShapeError(
        f"inconsistent {kind}: {shown}. States built from parts must agree with themselves; "
        "build them from model caches (kvstate.adapters) or with the transforms"
    )


def require(condition: bool, error: type[StateError], message: str) -> None:
    """Raise `error(message)` unless `condition` holds."""
    if not condition:
        raise error(message)
