"""Small frozen policies for the per-module API (SPEC §1).

This module imports nothing from the rest of shardwise, so the planner and every
layer above can depend on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar, cast

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]

_T = TypeVar("_T")


def _check_dtype(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got "
            f"{value!r} ({type(value).__name__}). Pass e.g. torch.bfloat16."
        )
    if not (value.is_floating_point or value.is_complex):
        raise ValueError(
            f"MixedPrecisionPolicy.{field}={value} is not a floating-point dtype; "
            "parameters and gradients can only be cast to floating-point (or complex) dtypes. "
            "Use torch.bfloat16, torch.float16 or torch.float32."
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision applied per module, at module boundaries.

    Args:
        param_dtype: dtype of the unsharded parameters, hence of forward and
            backward compute and of the parameter all-gather (the shard is cast
            before communicating). The optimizer always steps on the
            original-dtype shards. (Default: ``None``: the original dtype)
        reduce_dtype: dtype of gradient reduction. ``None`` with ``param_dtype``
            set reduces in ``param_dtype``. While gradient sync is off,
            gradients accumulate in this dtype. Equal to ``param_dtype`` means
            no extra cast. (Default: ``None``)
        output_dtype: cast floating-point forward outputs to this dtype.
            (Default: ``None``: no cast)
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``. (Default: ``True``)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{self.cast_forward_inputs!r}."
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: shards, gradients and optimizer state stay on the compute
    device. The base class of :class:`CPUOffloadPolicy`."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and the optimizer state on the CPU.

    Shards are copied host-to-device before each all-gather, reduced gradient
    shards device-to-host during backward, and the optimizer steps on the CPU.

    Args:
        pin_memory: pin the host shards so copies can overlap compute. A no-op
            when no accelerator is present. Turn off when host memory is short.
            (Default: ``True``)
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(
                f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}."
            )


def from_pytorch(value: _T, ours: Mapping[str, type]) -> _T:
    """PyTorch's own FSDP enum member, policy or config object (code that mixes
    imports hands them to shardwise) as the class of the same name in ``ours``,
    with the same fields; anything else unchanged. Recognised by the module
    path of its class: nothing of PyTorch's FSDP is imported. The fields are
    then checked as shardwise checks its own (PyTorch's classes check none)."""
    if type(value).__module__.split(".")[:3] != ["torch", "distributed", "fsdp"]:
        return value
    cls = ours.get(type(value).__name__)
    if cls is None:
        return value
    if isinstance(value, Enum):
        return cast(_T, cast(Any, cls)[value.name])
    names = [f.name for f in dataclasses.fields(cls)]
    return cast(_T, cls(**{n: getattr(value, n) for n in names if hasattr(value, n)}))


_POLICIES: dict[str, type] = {cls.__name__: cls for cls in (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy)}


def as_policy(value: _T) -> _T:
    """PyTorch's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` /
    ``CPUOffloadPolicy`` as shardwise's (see :func:`from_pytorch`)."""
    return from_pytorch(value, _POLICIES)
