"""Tensors inside the containers a forward takes and returns: the one place
that walks them, with PyTorch's FSDP's rules for each walk
([Note: walking forward containers]).

[Note: walking forward containers]
PyTorch's FSDP walks a forward's arguments and outputs three ways, and each
way treats containers differently; code that passes a ``defaultdict``, a
dict subclass, a set or a dataclass with a ``__post_init__`` sees the
difference, so each walk here follows PyTorch's:

- **Casts** (mixed-precision inputs and outputs, both fronts; device moves):
  :func:`map_tensors`, PyTorch's ``_apply_to_tensors``. It rebuilds every
  container: a dataclass with ``dataclasses.replace`` twice (once bare, once
  with every field, so ``__post_init__`` runs twice, and a field declared
  ``init=False`` is refused with dataclasses' ``ValueError``); an
  ``OrderedDict`` (a Hugging Face ``ModelOutput`` too) as its own class; any
  other dict as a plain ``dict``; namedtuples, lists, tuples and sets as
  their own type. Two departures, each where PyTorch fails and the model
  then runs: a dataclass *class* passed as an argument is left alone
  (PyTorch calls ``replace`` on it), and a ``PackedSequence`` is cast like
  the namedtuple it is (PyTorch casts a throwaway copy, and an LSTM with
  low-precision weights then refuses the full-precision data); one that
  nothing changed comes back as the same object, as PyTorch's does.
- **Finding the tensors that need autograd hooks** (inputs for the
  post-backward, outputs for the pre-backward): :func:`grad_tensors`, which
  rebuilds nothing. It opens namedtuples, dataclasses (every field), dicts,
  lists and tuples; sets too for the wrapper's outputs (FSDP1 registers
  its pre-backward hooks with its cast walk), not for ``fully_shard``'s.
- **Putting the inputs' autograd-tracked replacements back**:
  :func:`replace_grad_tensors`, the same order, rebuilding only a container
  whose contents changed; a dict subclass through its constructor, falling
  back to a shallow copy where the constructor takes no mapping (a
  ``defaultdict``, which PyTorch refuses with ``TypeError``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["cast_floats", "grad_tensors", "map_tensors", "replace_grad_tensors"]

# PyTorch's limit, so a container that holds itself is an error, not a RecursionError.
_MAX_DEPTH = 128


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor in it, by PyTorch's
    rules for casts ([Note: walking forward containers])."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _is_dataclass_instance(obj):
        fresh = dataclasses.replace(obj)
        changes = {f.name: map_tensors(fn, getattr(fresh, f.name)) for f in dataclasses.fields(fresh)}
        return dataclasses.replace(fresh, **changes)
    if isinstance(obj, OrderedDict):
        rebuilt = obj.__class__()
        for key, value in obj.items():
            rebuilt[key] = map_tensors(fn, value)
        return rebuilt
    if isinstance(obj, dict):
        return {key: map_tensors(fn, value) for key, value in obj.items()}
    if _is_namedtuple(obj):
        items = [map_tensors(fn, x) for x in obj]
        if isinstance(obj, PackedSequence) and all(a is b for a, b in zip(items, obj)):
            return obj  # PyTorch returns a PackedSequence itself
        return type(obj)(*items)
    if isinstance(obj, (list, tuple, set)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    return obj


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor in it cast to ``dtype``."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return map_tensors(cast, tree)


def _too_deep(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} exceeded max depth ({_MAX_DEPTH}), likely due to a circular reference in the output structure"
    )


def grad_tensors(obj: Any, *, in_sets: bool = False) -> list[torch.Tensor]:
    """The tensors in ``obj`` that require grad, in the order
    :func:`replace_grad_tensors` consumes them; nothing is rebuilt. With
    ``in_sets``, also those inside sets (FSDP1 registers its pre-backward
    hooks with its cast walk, which opens them)."""
    found: list[torch.Tensor] = []
    _collect(obj, found, 0, (list, tuple, set) if in_sets else (list, tuple))
    return found


# Module-level recursion, not closures: a closure that calls itself is a
# reference cycle holding the tensors it saw, and through their autograd
# graphs (which the garbage collector cannot see into) it kept a dropped model
# alive even across gc.collect() (test_a_dropped_model_is_freed).
def _collect(x: Any, found: list[torch.Tensor], depth: int, sequences: tuple[type, ...]) -> None:
    if depth >= _MAX_DEPTH:
        raise _too_deep("collect_grad_tensors")
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            found.append(x)
    elif _is_namedtuple(x):
        for item in x:
            _collect(item, found, depth + 1, sequences)
    elif _is_dataclass_instance(x):
        for f in dataclasses.fields(x):
            _collect(getattr(x, f.name), found, depth + 1, sequences)
    elif isinstance(x, dict):
        for value in x.values():
            _collect(value, found, depth + 1, sequences)
    elif isinstance(x, sequences):
        for item in cast(Iterable[Any], x):
            _collect(item, found, depth + 1, sequences)


def replace_grad_tensors(obj: Any, replacements: Iterator[torch.Tensor]) -> Any:
    """``obj`` with each tensor that requires grad replaced by the next of
    ``replacements`` (in :func:`grad_tensors`' order); a container is rebuilt
    only if something inside it was replaced."""
    return _put(obj, replacements, 0)


def _put(x: Any, replacements: Iterator[torch.Tensor], depth: int) -> Any:
    if depth >= _MAX_DEPTH:
        raise _too_deep("replace_grad_tensors")
    if isinstance(x, torch.Tensor):
        return next(replacements) if x.requires_grad else x
    if _is_namedtuple(x):
        items = [_put(item, replacements, depth + 1) for item in x]
        return type(x)(*items) if any(a is not b for a, b in zip(items, x)) else x
    if _is_dataclass_instance(x):
        changes = {}
        for f in dataclasses.fields(x):
            old = getattr(x, f.name)
            new = _put(old, replacements, depth + 1)
            if new is not old:
                changes[f.name] = new
        if not changes:
            return x
        try:
            return dataclasses.replace(x, **changes)
        except TypeError as e:
            raise TypeError(
                f"Failed to reconstruct dataclass {type(x).__qualname__} via dataclasses.replace(). "
                f"Dataclasses used as FSDP module inputs/outputs must support dataclasses.replace(): {e}"
            ) from None
    if isinstance(x, dict):
        pairs = {key: _put(value, replacements, depth + 1) for key, value in x.items()}
        if all(pairs[key] is value for key, value in x.items()):
            return x
        if type(x) is dict:
            return pairs
        try:
            return type(x)(pairs)
        except TypeError:  # a constructor that takes no mapping first (defaultdict)
            rebuilt = copy.copy(x)
            rebuilt.update(pairs)
            return rebuilt
    if isinstance(x, (list, tuple)):
        items = [_put(item, replacements, depth + 1) for item in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        try:
            return type(x)(items)
        except TypeError:  # a subclass with its own constructor
            return list(items) if isinstance(x, list) else tuple(items)
    return x
