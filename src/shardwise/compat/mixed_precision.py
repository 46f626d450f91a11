"""``MixedPrecision`` (wrapper API) on the engine's ``MixedPrecisionPolicy``.

Parameters and gradient reduction map one to one (``param_dtype``,
``reduce_dtype``; ``keep_low_precision_grads`` is a group setting). The rest
is the wrapper's own, outside the engine:

* forward inputs are cast by the wrapper's ``forward`` (every wrapper:
  ``cast_forward_inputs``; the root also: ``cast_root_forward_inputs``), so
  the engine's own input cast is off;
* buffers are cast to ``buffer_dtype`` once, when the root first runs, and
  state dicts save them in their original dtype;
* with an auto-wrap policy, modules of ``_module_classes_to_ignore`` are
  wrapped on their own without mixed precision and run in float32, their
  outputs cast back to the dtype their inputs came in.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from shardwise._engine.trees import cast_floats, map_tensors
from shardwise.policies import MixedPrecisionPolicy

from .config import MixedPrecision

__all__ = ["mark_full_precision_modules", "to_mp_policy"]

# module -> the floating dtype its last input had, to cast its output back.
_INPUT_DTYPES: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()
# modules already given the float32 hooks (a model wrapped twice must not stack them).
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def to_mp_policy(mp: MixedPrecision | None) -> MixedPrecisionPolicy:
    """The engine policy for ``mp``; inputs are cast by the wrapper, not the engine."""
    if mp is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=False)


def _to_float32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != torch.float32:
            _INPUT_DTYPES[module] = x.dtype
            return x.to(torch.float32)
        return x

    return map_tensors(cast, args)  # type: ignore[no-any-return]


def _back_to_input_dtype(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    dtype = _INPUT_DTYPES.get(module)
    if dtype is None:
        return output
    return cast_floats(output, dtype)


def mark_full_precision_modules(
    root: nn.Module, classes: tuple[type[nn.Module], ...], ignored: set[nn.Module]
) -> set[type[nn.Module]]:
    """Give every module of ``classes`` under ``root`` forward hooks that run it
    in float32 and cast its output back; return the classes found."""
    found: set[type[nn.Module]] = set()
    if not classes:
        return found
    for m in root.modules():
        if m in ignored or not isinstance(m, classes):
            continue
        found.add(type(m))
        if m in _HOOKED:
            continue
        _HOOKED.add(m)
        m.register_forward_pre_hook(_to_float32, prepend=False)
        m.register_forward_hook(_back_to_input_dtype, prepend=False)
    return found
