"""Tensors inside the containers a forward takes and returns: the one place
that walks them (the engine's input casts and device moves, and the wrapper
API's casts), looking inside tuples, namedtuples, lists, dicts and
dataclasses as PyTorch's FSDP does (``torch.utils._pytree`` does not open
dataclasses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["cast_floats", "map_tensors"]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in ``obj``, looking inside tuples,
    namedtuples, lists, dicts and dataclasses (as PyTorch's FSDP does)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    return obj


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor in it cast to ``dtype``."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return map_tensors(cast, tree)
