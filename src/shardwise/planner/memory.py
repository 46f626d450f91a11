"""Per-rank memory of a ``fully_shard``-ed model, computed before anything is
allocated (the model may live on the meta device).

[Note: the per-rank memory formula]
For a model split into communication groups (each ``fully_shard``-ed module
owns the parameters no nested ``fully_shard``-ed module owns; the root owns
the rest) sharded over ``S`` ranks (``S`` = the world size, or the size of
the inner "shard" dimension of a 2-D hybrid mesh), rank ``r`` holds

    model state  = P_r + G_r + k * P_r
        P_r  sum over parameters of numel(torch.chunk(param, S, dim)[r % S])
             x element size of the parameter's own dtype (the sharded
             parameters, which the optimizer steps on)
        G_r  the same count again: the reduced gradient shards, kept in the
             parameter's dtype (mixed precision upcasts after reduction)
             (the engine stores both padded to the first chunk's rows, so
             every rank's buffers hold ``padding`` bytes more than a short
             chunk needs: ``MemoryEstimate.padding``)
        k    optimizer states per element: 2 for AdamW / Adam (``exp_avg``,
             ``exp_avg_sq``, each like the parameter: fp32 for fp32
             parameters); AdamW's scalar ``step`` is not counted
  + unsharded  = full bytes, in ``param_dtype``, of the groups whose whole
             parameters exist at once during forward/backward:
             the largest two non-root groups (the one computing and the one
             prefetched) when groups reshard after forward; every non-root
             group when they do not (``reshard_after_forward=False``, "shard
             grad op": parameters stay gathered from forward to backward);
             with ``reshard_after_forward=k`` (an int), the largest two plus
             every other group's post-forward ``1/k`` share
  + root       = the root group's full bytes in ``param_dtype``: the root keeps
             its parameters gathered after forward (its backward starts right
             away), so they are resident through the step

With ``CPUOffloadPolicy`` the model state lives in host memory and only the
unsharded and root terms occupy the device. Activations, the all-gather and
reduce-scatter staging buffers of one group, and allocator slack come on top
and are not estimated here. A plain unsharded copy of the model holds
``P + G + k * P`` with every parameter whole (``unsharded_model_state``).

This module depends on ``shardwise.policies`` and torch alone (DESIGN.md: the
planner is the only home of memory formulas).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.layout import chunk_span
from shardwise.policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "GroupSpec",
    "MemoryEstimate",
    "ParamSpec",
    "estimate_memory",
    "groups_of",
    "shard_numel",
    "unsharded_model_state",
]

ADAMW_STATES = 2
"""Optimizer state tensors per parameter element for Adam / AdamW."""


@dataclass(frozen=True)
class ParamSpec:
    """Shape and dtype of one parameter, and the dim it is sharded on."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int = 0

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def element_size(self) -> int:
        """Bytes per element of the parameter's own dtype."""
        return torch.empty((), dtype=self.dtype, device="meta").element_size()


@dataclass(frozen=True)
class GroupSpec:
    """The parameters one ``fully_shard`` call groups into one all-gather."""

    name: str
    params: tuple[ParamSpec, ...]
    is_root: bool = False

    @property
    def numel(self) -> int:
        """Elements of all the group's whole parameters."""
        return sum(p.numel for p in self.params)

    def unsharded_bytes(self, param_dtype: torch.dtype | None) -> int:
        """Bytes of the group's whole parameters in ``param_dtype`` (``None``: their own dtypes)."""
        if param_dtype is None:
            return sum(p.numel * p.element_size for p in self.params)
        size = torch.empty((), dtype=param_dtype, device="meta").element_size()
        return self.numel * size


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory, in bytes, by term of the formula in
    [Note: the per-rank memory formula]."""

    rank: int
    shard_size: int
    sharded_params: int
    sharded_grads: int
    optimizer_state: int
    unsharded_peak: int
    root_unsharded: int
    offloaded: bool
    padding: int = 0  # bytes each padded shard buffer (parameters, and gradients alike) holds beyond the chunk

    @property
    def model_state(self) -> int:
        """Sharded parameters + gradients + optimizer state."""
        return self.sharded_params + self.sharded_grads + self.optimizer_state

    @property
    def total(self) -> int:
        """Everything estimated, wherever it lives."""
        return self.model_state + self.unsharded_peak + self.root_unsharded

    @property
    def device(self) -> int:
        """The part on the compute device (all of it unless offloaded)."""
        return self.total - (self.model_state if self.offloaded else 0)


def shard_numel(shape: Sequence[int], num_shards: int, shard_index: int, dim: int = 0) -> int:
    """Elements of ``torch.chunk(tensor_of(shape), num_shards, dim)[shard_index]``
    (0 when there are fewer chunks than shards).

    Args:
        shape: the whole tensor's shape.
        num_shards: ranks sharing the tensor (``>= 1``).
        shard_index: which of them (``0 <= shard_index < num_shards``).
        dim: the sharded dimension. (Default: ``0``)
    """
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(
            f"shard_numel: shard_index={shard_index} must lie in [0, num_shards={num_shards}) "
            "and num_shards must be >= 1."
        )
    if len(shape) == 0:
        # fully_shard treats a scalar as one row
        return 1 if shard_index == 0 else 0
    mine = chunk_span(shape[dim], num_shards, shard_index)[1]
    rest = 1
    for i, size in enumerate(shape):
        if i != dim:
            rest *= size
    return mine * rest


def _specs(params: Iterable[nn.Parameter]) -> tuple[ParamSpec, ...]:
    return tuple(ParamSpec(tuple(p.shape), p.dtype) for p in params)


def groups_of(model: nn.Module, wrapped: Sequence[nn.Module]) -> list[GroupSpec]:
    """The communication groups ``fully_shard`` would make: one per module of
    ``wrapped`` (pass them bottom-up, in the order ``fully_shard`` is applied
    to them), then the root ``model`` with every parameter left over. A
    parameter shared by several modules (tied weights) belongs to the first
    group that sees it. Works on the meta device.

    Args:
        model: the root module (``fully_shard``-ed last).
        wrapped: the modules ``fully_shard``-ed before the root.
    """
    owned: set[int] = set()
    groups: list[GroupSpec] = []
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for module in wrapped:
        mine = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in mine)
        groups.append(GroupSpec(names.get(id(module), type(module).__name__), _specs(mine)))
    rest = [p for p in model.parameters() if id(p) not in owned]
    groups.append(GroupSpec("<root>", _specs(rest), is_root=True))
    return groups


def _check_groups(groups: Sequence[GroupSpec]) -> None:
    if not groups or not all(isinstance(g, GroupSpec) for g in groups):
        raise TypeError(
            f"estimate_memory: groups must be a non-empty sequence of GroupSpec, got {groups!r}. "
            "Build it with groups_of(model, wrapped_modules)."
        )


def estimate_memory(
    groups: Sequence[GroupSpec],
    *,
    shard_size: int,
    rank: int = 0,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int = True,
    optimizer_states: int = ADAMW_STATES,
) -> MemoryEstimate:
    """Rank ``rank``'s memory for ``groups`` sharded over ``shard_size`` ranks,
    by the formula in [Note: the per-rank memory formula].

    Args:
        groups: the communication groups, e.g. from :func:`groups_of`.
        shard_size: ranks one parameter is sharded over: the world size, or
            the inner ("shard") dimension of a 2-D hybrid mesh.
        rank: the global rank; its shard index is ``rank % shard_size``
            (a ``(replicate, shard)`` mesh laid out row-major). (Default: ``0``)
        mp_policy: mixed precision; its ``param_dtype`` sizes the unsharded
            terms. (Default: ``None``: no mixed precision)
        offload_policy: a ``CPUOffloadPolicy`` moves the model state to the
            host (see :attr:`MemoryEstimate.device`). (Default: ``None``: no offload)
        reshard_after_forward: as given to ``fully_shard`` for the non-root
            groups: ``True`` (free after forward), ``False`` (keep until after
            backward) or an int (reshard to groups of that size). (Default: ``True``)
        optimizer_states: optimizer state tensors per parameter element.
            (Default: ``2``, Adam / AdamW)
    """
    _check_groups(groups)
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"estimate_memory: shard_size={shard_size!r} must be an int >= 1 (e.g. the world size).")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"estimate_memory: rank={rank!r} must be an int >= 0.")
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(
            f"estimate_memory: optimizer_states={optimizer_states!r} must be an int >= 0 (2 for AdamW, 0 for SGD)."
        )
    param_dtype = mp_policy.param_dtype if mp_policy is not None else None
    index = rank % shard_size
    sharded = sum(
        shard_numel(p.shape, shard_size, index, p.shard_dim) * p.element_size for g in groups for p in g.params
    )
    # Every rank stores its chunk padded to the first chunk's rows (collectives need equal sizes).
    padded = sum(shard_numel(p.shape, shard_size, 0, p.shard_dim) * p.element_size for g in groups for p in g.params)
    inner = sorted((g.unsharded_bytes(param_dtype) for g in groups if not g.is_root), reverse=True)
    if reshard_after_forward is False:
        unsharded = sum(inner)
    elif reshard_after_forward is True or reshard_after_forward <= 1:
        unsharded = sum(inner[:2])
    else:
        unsharded = sum(inner[:2]) + sum(inner[2:]) // reshard_after_forward
    root = sum(g.unsharded_bytes(param_dtype) for g in groups if g.is_root)
    offloaded = offload_policy is not None and type(offload_policy) is not OffloadPolicy
    return MemoryEstimate(
        rank=rank,
        shard_size=shard_size,
        sharded_params=sharded,
        sharded_grads=sharded,
        optimizer_state=optimizer_states * sharded,
        unsharded_peak=unsharded,
        root_unsharded=root,
        offloaded=offloaded,
        padding=padded - sharded,
    )


def unsharded_model_state(groups: Sequence[GroupSpec], *, optimizer_states: int = ADAMW_STATES) -> int:
    """Bytes of parameters + gradients + optimizer state of a plain, unsharded
    copy of the model (what every rank would hold under DDP).

    Args:
        groups: the model's parameters, e.g. from :func:`groups_of`.
        optimizer_states: optimizer state tensors per element. (Default: ``2``, AdamW)
    """
    _check_groups(groups)
    full = sum(g.unsharded_bytes(None) for g in groups)
    return (2 + optimizer_states) * full
