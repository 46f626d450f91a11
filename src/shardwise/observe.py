"""What the engine tells observers: the regions it is in (all-gather,
copy-out, reduce-scatter, ...) and the storages it resizes in place.

The planner's memory tracker (``shardwise.planner.MemoryTracker``) is the
observer: a dispatch mode sees every tensor an operator creates, but not an
untyped storage resized in place (how the engine frees and re-allocates
unsharded parameters, as PyTorch's FSDP does), nor why a buffer was made.
With no observer registered, ``region`` hands back one shared no-op context
and the engine pays one list check per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

__all__ = ["Observer", "observing", "region", "register", "storage_resized", "tag", "unregister"]


class Observer(Protocol):
    """Receives the engine's events; see the module docstring."""

    def enter_region(self, kind: str, name: str) -> None:
        """The engine enters ``kind`` (e.g. ``"all_gather"``) for the group ``name``."""

    def exit_region(self) -> None:
        """The engine leaves the innermost region."""

    def storage_resized(self, storage: torch.UntypedStorage, old_nbytes: int) -> None:
        """``storage`` was resized in place from ``old_nbytes`` (its new size is ``storage.nbytes()``)."""

    def tag(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` hold ``category`` (e.g. ``"gradients"``: unsharded gradients about to be reduced)."""


_OBSERVERS: list[Observer] = []
_NOTHING = nullcontext()


def register(observer: Observer) -> None:
    """Start telling ``observer`` about the engine's regions and storage resizes."""
    _OBSERVERS.append(observer)


def unregister(observer: Observer) -> None:
    """Stop telling ``observer`` (no-op if it was not registered)."""
    if observer in _OBSERVERS:
        _OBSERVERS.remove(observer)


def observing() -> bool:
    """Whether any observer is registered."""
    return bool(_OBSERVERS)


class _Region:
    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name

    def __enter__(self) -> None:
        for obs in _OBSERVERS:
            obs.enter_region(self.kind, self.name)

    def __exit__(self, *exc: object) -> None:
        for obs in _OBSERVERS:
            obs.exit_region()


def region(kind: str, name: str) -> AbstractContextManager[Any]:
    """A context telling observers the engine is in ``kind`` for ``name``; a no-op when none observe."""
    if _OBSERVERS:
        return _Region(kind, name)
    return _NOTHING


def tag(category: str, tensors: Iterable[torch.Tensor]) -> None:
    """Tell observers ``tensors`` hold ``category``."""
    for obs in _OBSERVERS:
        obs.tag(category, tensors)


def storage_resized(storage: torch.UntypedStorage, old_nbytes: int) -> None:
    """Tell observers ``storage`` was resized in place from ``old_nbytes``."""
    for obs in _OBSERVERS:
        obs.storage_resized(storage, old_nbytes)
