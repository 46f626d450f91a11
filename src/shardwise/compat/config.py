"""The wrapper API's enums and configuration classes (SPEC §2), with PyTorch's
names, fields and defaults (those of PyTorch's FSDP ``api`` module), so that
code written for PyTorch's ``FullyShardedDataParallel`` runs unchanged.

Unlike shardwise's own policies these are plain (mutable) dataclasses, as
PyTorch's are: user code that builds a config and then sets a field keeps
working. Each validates its fields when built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise.errors import ConfigError, ConfigTypeError
from shardwise.policies import from_pytorch as _from_pytorch

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]


class ShardingStrategy(Enum):
    """What is sharded, and when parameters are gathered (see SPEC §2).

    - ``FULL_SHARD``: parameters, gradients and optimizer state sharded;
      parameters gathered before forward and before backward, freed after each.
    - ``SHARD_GRAD_OP``: parameters gathered before forward and kept until the
      end of backward (and across ``no_sync()``); gradients and optimizer
      state sharded.
    - ``NO_SHARD``: everything replicated, gradients all-reduced (like DDP).
    - ``HYBRID_SHARD``: ``FULL_SHARD`` within a node, replicated across nodes.
    - ``_HYBRID_SHARD_ZERO2``: ``SHARD_GRAD_OP`` within a node, replicated
      across nodes.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When backward gathers the next group's parameters (``None`` disables it).

    - ``BACKWARD_PRE``: before the current group's gradient computation (most
      overlap, most memory).
    - ``BACKWARD_POST``: after the current group's gradient computation, once
      its parameters are freed (less memory).
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class StateDictType(Enum):
    """What ``state_dict()`` returns and ``load_state_dict()`` expects.

    - ``FULL_STATE_DICT``: whole tensors with the original names, like an
      unwrapped model's.
    - ``LOCAL_STATE_DICT``: each rank's local shards (plain tensors) with the
      original names; only meaningful to the same sharding.
    - ``SHARDED_STATE_DICT``: sharded ``DTensor`` values with the original
      names; loadable under another world size through
      ``torch.distributed.checkpoint``.
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(Enum):
    """How an optimizer state dict's ``"state"`` is keyed: by parameter name or
    by the optimizer's parameter index."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


def _check_bool(owner: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{owner}.{field} must be a bool, got {value!r} ({type(value).__name__}).")


def _check_dtype(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise ConfigTypeError(
            f"MixedPrecision.{field} must be a torch.dtype or None, got {value!r} "
            f"({type(value).__name__}). Pass e.g. torch.bfloat16."
        )
    if not value.is_floating_point:
        raise ConfigError(
            f"MixedPrecision.{field}={value} is not a floating-point dtype; use "
            "torch.bfloat16, torch.float16 or torch.float32."
        )


@dataclass
class MixedPrecision:
    """Mixed precision for the wrapper API.

    Args:
        param_dtype: dtype of the unsharded parameters, hence of forward and
            backward compute and of the all-gather. The sharded parameters the
            optimizer steps on, and checkpoints, stay full precision.
            (Default: ``None``: the original dtype)
        reduce_dtype: dtype of gradient reduction; ``None`` with ``param_dtype``
            set reduces in ``param_dtype``. (Default: ``None``)
        buffer_dtype: buffers are cast to it at the first forward and stay so;
            full-precision and local-free state dicts save them in their
            original dtype. (Default: ``None``: no cast)
        keep_low_precision_grads: keep reduced gradients in the reduction dtype
            instead of upcasting them for the optimizer. (Default: ``False``)
        cast_forward_inputs: every instance casts floating-point forward
            inputs to ``param_dtype``. (Default: ``False``)
        cast_root_forward_inputs: the root casts floating-point forward inputs
            to ``param_dtype`` also when ``cast_forward_inputs`` is off (as
            FSDP1 does). (Default: ``True``)
        _module_classes_to_ignore: with an ``auto_wrap_policy``, modules of
            these classes get their own wrapper with mixed precision disabled
            and run in float32. (Default: ``(_BatchNorm,)``)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            _check_dtype(field, getattr(self, field))
        for field in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            _check_bool("MixedPrecision", field, getattr(self, field))
        classes = self._module_classes_to_ignore
        if not isinstance(classes, (list, tuple, set, frozenset)) or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in classes
        ):
            raise ConfigTypeError(
                "MixedPrecision._module_classes_to_ignore must be a sequence of nn.Module "
                f"subclasses, got {classes!r}. Pass e.g. (torch.nn.BatchNorm2d,) or ()."
            )


@dataclass
class CPUOffload:
    """CPU offloading for the wrapper API.

    Args:
        offload_params: keep sharded parameters on the CPU (and with them the
            gradients, so the optimizer steps on the CPU). (Default: ``False``)
    """

    offload_params: bool = False

    def __post_init__(self) -> None:
        _check_bool("CPUOffload", "offload_params", self.offload_params)


@dataclass
class StateDictConfig:
    """Base of the model state-dict configurations.

    Args:
        offload_to_cpu: move state-dict values to the CPU. (Default: ``False``)
    """

    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        _check_bool(type(self).__name__, "offload_to_cpu", self.offload_to_cpu)


@dataclass
class FullStateDictConfig(StateDictConfig):
    """For ``FULL_STATE_DICT``. Saving with ``offload_to_cpu=True,
    rank0_only=True`` keeps one CPU copy of the model, on rank 0.

    Args:
        rank0_only: only rank 0 returns the state dict; the other ranks take
            part in the gathers and return ``{}``. (Default: ``False``)
    """

    rank0_only: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bool("FullStateDictConfig", "rank0_only", self.rank0_only)


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """For ``LOCAL_STATE_DICT``."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """For ``SHARDED_STATE_DICT``.

    Args:
        _use_dtensor: PyTorch's switch between ``ShardedTensor`` and
            ``DTensor`` values. shardwise's sharded values are always
            ``DTensor`` (what its parameters are), which
            ``torch.distributed.checkpoint`` saves and reshards alike.
            (Default: ``False``)
    """

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configurations.

    Args:
        offload_to_cpu: move state values to the CPU. (Default: ``True``)
    """

    offload_to_cpu: bool = True

    def __post_init__(self) -> None:
        _check_bool(type(self).__name__, "offload_to_cpu", self.offload_to_cpu)


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """For ``FULL_STATE_DICT`` optimizer state.

    Args:
        rank0_only: only rank 0 returns the state; the others return ``{}``.
            (Default: ``False``)
    """

    rank0_only: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bool("FullOptimStateDictConfig", "rank0_only", self.rank0_only)


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """For ``LOCAL_STATE_DICT`` optimizer state (``offload_to_cpu`` defaults to
    ``False`` here)."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """For ``SHARDED_STATE_DICT`` optimizer state.

    Args:
        _use_dtensor: see :class:`ShardedStateDictConfig`; values are always
            ``DTensor``. (Default: ``False``)
    """

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """A state-dict type with its model and optimizer configurations."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


#: The configuration class each state-dict type takes (model, optimizer).
CONFIG_FOR_TYPE: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


_T = TypeVar("_T")
_OURS = {cls.__name__: cls for cls in (
    ShardingStrategy, BackwardPrefetch, StateDictType, OptimStateKeyType, MixedPrecision, CPUOffload,
    StateDictConfig, FullStateDictConfig, LocalStateDictConfig, ShardedStateDictConfig,
    OptimStateDictConfig, FullOptimStateDictConfig, LocalOptimStateDictConfig, ShardedOptimStateDictConfig,
)}


def from_pytorch(value: _T) -> _T:
    """PyTorch's own FSDP enum member or config object (e.g. its
    ``CPUOffload()``, which code mixing imports, or a default argument bound
    to PyTorch's class, hands to shardwise) as the shardwise one of the same
    name and fields; anything else unchanged (see
    :func:`shardwise.policies.from_pytorch`)."""
    return _from_pytorch(value, _OURS)
