"""Placeholder: being written."""

from typing import Any


def save(path: Any, state: Any, metadata: Any = None) -> None:
    raise NotImplementedError


def load(path: Any) -> Any:
    raise NotImplementedError
