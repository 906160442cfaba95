"""Which part of a distributed model a state holds: `Placement`, and its text form (the
`ModelState.placement` static, and the `kvstate.placement` entry of a saved file's metadata).

A model split with mx.distributed is split one of two ways (mlx-lm's own methods):
- tensor parallel (`model.shard(group)`): every rank runs every layer on its share of the
  attention / linear-attention heads, so its state holds every layer, its heads only;
- pipeline parallel (`model.model.pipeline(group)`): every rank runs a contiguous run of
  layers on whole heads, so its state holds those layers only.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from ._errors import PlacementError, StateError
from ._ints import is_int

SCHEMES = ("tensor", "pipeline")
_TEXT = re.compile(r"(tensor|pipeline) rank (\d+) of (\d+)(?:, layers (\d+):(\d+) of (\d+|\?))?")


@attrs.frozen
class Placement:
    """One rank's part of a model split over `size` processes.

    `scheme`: "tensor" (heads split over the ranks) or "pipeline" (layers split);
    `layers`: for a pipeline, the [start, stop) range of the model's layers this rank holds
    (mlx-lm gives rank 0 the last layers); `total_layers`: the model's layer count, when known.
    """

    scheme: str
    rank: int
    size: int
    layers: tuple[int, int] | None = None
    total_layers: int | None = None

    def __attrs_post_init__(self) -> None:
        problems = []
        if self.scheme not in SCHEMES:
            problems.append(f"scheme {self.scheme!r} is not one of {SCHEMES}")
        if not (is_int(self.size) and is_int(self.rank)):
            problems.append(f"rank and size must be ints; got {self.rank!r}, {self.size!r}")
        elif not 0 <= self.rank < self.size:
            problems.append(f"rank {self.rank} is outside 0..{self.size - 1}")
        if self.total_layers is not None and not (
            is_int(self.total_layers) and self.total_layers > 0
        ):
            problems.append(f"total_layers must be None or an int >= 1; got {self.total_layers!r}")
        if (self.scheme == "pipeline") != (self.layers is not None):
            problems.append("a pipeline placement gives its layers, a tensor placement does not")
        if self.layers is not None and not (
            isinstance(self.layers, tuple)
            and len(self.layers) == 2
            and all(map(is_int, self.layers))
        ):
            problems.append(f"layers must be a (start, stop) pair of ints; got {self.layers!r}")
        elif self.layers is not None and not problems:
            start, stop = self.layers
            if not 0 <= start < stop or (
                self.total_layers is not None and stop > self.total_layers
            ):
                problems.append(f"layers {start}:{stop} of {self.total_layers} is not a range")
        if problems:
            raise PlacementError(f"invalid Placement: {'; '.join(problems)}")

    def __str__(self) -> str:
        text = f"{self.scheme} rank {self.rank} of {self.size}"
        if self.layers is None:
            return text
        total = "?" if self.total_layers is None else self.total_layers
        return f"{text}, layers {self.layers[0]}:{self.layers[1]} of {total}"

    @classmethod
    def parse(cls, text: str) -> Placement | None:
        """The placement a `str(placement)` wrote; None for "" (a single process)."""
        if text == "":
            return None
        found = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if found is None:
            raise PlacementError(
                f"{text!r} is not a placement; expected '' (a single process), 'tensor rank R "
                "of N' or 'pipeline rank R of N, layers START:STOP of TOTAL'"
            )
        scheme, rank, size, start, stop, total = found.groups()
        layers = None if start is None else (int(start), int(stop))
        whole = None if total in (None, "?") else int(total)
        return cls(scheme, int(rank), int(size), layers, whole)


def placement_of(state: Any) -> Placement | None:
    """The placement a state records (None: a single-process state, or not a ModelState)."""
    return Placement.parse(getattr(state, "placement", ""))


def checked_group(group: Any, where: str) -> Any:
    """An `mx.distributed.Group` (anything with `rank()` and `size()`), or None."""
    if group is not None and not (
        callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))
    ):
        raise StateError(
            f"{where}: group must be an mx.distributed.Group (mx.distributed.init()) or None; "
            f"got {group!r:.60}"
        )
    return group


def check_rank(state: Any, rank: int, size: int, where: str) -> None:
    """Raise PlacementError unless `state` belongs to rank `rank` of a group of `size`."""
    placed = placement_of(state)
    if placed is None:
        if size > 1:
            raise PlacementError(
                f"{where} holds a single-process state, but this group has {size} ranks; "
                "split it with kvstate.distributed.scatter first (or load it without group=)"
            )
        return
    if (placed.rank, placed.size) != (rank, size):
        raise PlacementError(
            f"{where} holds the state of {placed} (rank {placed.rank} of a world of "
            f"{placed.size}), but this is rank {rank} of a world of {size}; load the file that "
            f"rank {rank} saved, with the same number of processes and the same sharding"
        )
