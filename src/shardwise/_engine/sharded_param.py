"""One parameter between its sharded form (a DTensor over the mesh, what the
optimizer and state dicts see) and its unsharded form (a plain parameter that
exists only while its module computes)."""

from __future__ import annotations

from enum import Enum, auto
from typing import NamedTuple, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardwise.mesh import MeshInfo


class ShardedState(Enum):
    """Where a parameter group's data lives right now."""

    SHARDED = auto()  # only the shards exist
    SHARDED_POST_FORWARD = auto()  # shards over a smaller group (reshard_after_forward=int)
    UNSHARDED = auto()  # the full parameters exist and are registered on the modules


class ShardLayout(NamedTuple):
    """How one tensor is cut into ``num_shards`` chunks along ``dim``, exactly as
    ``torch.chunk`` cuts it: every chunk holds ``chunk`` rows except the last
    non-empty one; ranks past the last chunk hold nothing. Each rank's chunk is
    stored padded to ``chunk`` rows so that collectives see equal sizes."""

    num_shards: int
    rank: int
    dim: int
    dim_size: int
    chunk: int
    padded_shape: torch.Size

    @staticmethod
    def make(shape: torch.Size, dim: int, num_shards: int, rank: int) -> ShardLayout:
        dim_size = shape[dim]
        chunk = -(-dim_size // num_shards)
        padded = list(shape)
        padded[dim] = chunk
        return ShardLayout(num_shards, rank, dim, dim_size, chunk, torch.Size(padded))

    def rows(self, rank: int) -> int:
        """Real (unpadded) rows of ``rank``'s chunk."""
        return max(0, min(self.chunk, self.dim_size - rank * self.chunk))

    @property
    def local_rows(self) -> int:
        return self.rows(self.rank)

    @property
    def padded_numel(self) -> int:
        return self.padded_shape.numel()

    def gather_into(self, full: torch.Tensor, gathered: torch.Tensor) -> None:
        """Copy every rank's padded chunk (``gathered``: [num_shards, *padded_shape])
        into the full tensor, dropping padding. At most two copies."""
        if self.chunk == 0:
            return
        whole = self.dim_size // self.chunk  # ranks whose chunk is full
        if whole:
            dst = self._split_rows(full.narrow(self.dim, 0, whole * self.chunk), whole)
            dst.movedim(self.dim, 0).copy_(gathered[:whole])
        rem = self.dim_size - whole * self.chunk
        if rem:
            full.narrow(self.dim, whole * self.chunk, rem).copy_(
                gathered[whole].narrow(self.dim, 0, rem)
            )

    def scatter_from(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Inverse of :meth:`gather_into`: lay ``full`` out as padded chunks in
        ``out`` ([num_shards, *padded_shape]), zeroing the padding."""
        if self.chunk == 0:
            return
        whole = self.dim_size // self.chunk
        if whole:
            src = self._split_rows(full.narrow(self.dim, 0, whole * self.chunk), whole)
            out[:whole].copy_(src.movedim(self.dim, 0))
        rem = self.dim_size - whole * self.chunk
        if whole < self.num_shards:
            tail = out[whole]
            if rem:
                tail.narrow(self.dim, 0, rem).copy_(full.narrow(self.dim, whole * self.chunk, rem))
            tail.narrow(self.dim, rem, self.chunk - rem).zero_()
            out[whole + 1 :].zero_()

    def _split_rows(self, t: torch.Tensor, whole: int) -> torch.Tensor:
        """View ``t``'s ``dim`` (``whole * chunk`` long) as ``(whole, chunk)``."""
        shape = list(t.shape)
        return t.view(*shape[: self.dim], whole, self.chunk, *shape[self.dim + 1 :])

    def local_chunk(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """``rank``'s unpadded chunk of ``full`` (a view)."""
        r = self.rank if rank is None else rank
        rows = self.rows(r)
        start = min(r * self.chunk, self.dim_size)
        return full.narrow(self.dim, start, rows)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (typed access to ``_local_tensor``)."""
    local: torch.Tensor = cast(DTensor, t)._local_tensor
    return local


def free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class ShardedParam:
    """One managed parameter.

    ``sharded_param`` (a DTensor ``nn.Parameter``) is the source of truth; its
    local tensor is a view of ``sharded_data``, this rank's chunk padded to the
    chunk size (itself usually a view into the group's one flat buffer, so the
    all-gather needs no copy-in). ``unsharded_param`` is a plain ``nn.Parameter``
    whose storage is allocated only while unsharded; the tensor object itself
    persists so that autograd's saved references stay valid across reshard and
    re-unshard.
    """

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        info: MeshInfo,
        shard_dim: int,
        fqn: str,
    ) -> None:
        # Every (module, attribute) that registers this parameter (tied weights).
        self.owners = owners
        self.fqn = fqn
        self.info = info
        self.shard_dim = shard_dim
        self.orig_dtype = param.dtype
        self.full_shape = param.shape
        self.layout = ShardLayout.make(param.shape, shard_dim, info.shard_size, info.shard_rank)
        # Filled by ParamGroup.init_flat_storage / reset.
        self.sharded_data: torch.Tensor = torch.empty(0)
        self.sharded_param: nn.Parameter = param
        # Only for building the first DTensor; never keep the full tensor alive.
        self._initial_requires_grad = param.requires_grad
        # Lazily created at first unshard, in the all-gather dtype.
        self.unsharded_param: nn.Parameter | None = None
        # Gradients accumulated while sync is off, kept in the reduce dtype.
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        # Post-forward shard (reshard_after_forward=int): view into the group's buffer.
        self.post_forward_layout: ShardLayout | None = None

    # ---- sharded side -------------------------------------------------------
    @torch.no_grad()  # the copy must not tie the shard buffer to the source's graph
    def adopt_storage(self, padded: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (a full tensor or this rank's local chunk) into
        ``padded`` and (re)build the DTensor parameter over it."""
        rows = self.layout.local_rows
        local = padded.narrow(self.shard_dim, 0, rows)
        if local.device.type != "meta":
            if source.shape == self.full_shape and self.layout.num_shards > 1:
                source = self.layout.local_chunk(source)
            if source.device.type != "meta":
                local.copy_(source)
            padded.narrow(self.shard_dim, rows, self.layout.chunk - rows).zero_()
        self.sharded_data = padded
        if isinstance(self.sharded_param, DTensor) and self.sharded_param._local_tensor.shape == local.shape:
            # Keep the same Parameter object (optimizers may already hold it).
            self.sharded_param._local_tensor = local
        else:
            self.sharded_param = nn.Parameter(self._as_dtensor(local), requires_grad=self._initial_requires_grad)
        self.register_sharded()

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap this rank's (unpadded) chunk as a DTensor of the full shape."""
        with torch.no_grad():
            return DTensor.from_local(
                local,
                self.info.mesh,
                self.info.placements(self.shard_dim),
                run_check=False,
                shape=self.full_shape,
                stride=_contiguous_stride(self.full_shape),
            )

    def local_is_adopted(self) -> bool:
        """Whether the registered DTensor still views ``sharded_data`` (false after
        ``to_empty`` / ``_apply`` / ``load_state_dict(assign=True)`` replaced it)."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if current is not self.sharded_param and current is not self.unsharded_param:
            return False
        local = local_of(self.sharded_param)
        return (
            local.device == self.sharded_data.device
            and local.dtype == self.sharded_data.dtype
            and local.device.type != "meta"
            and local.data_ptr() == self.sharded_data.data_ptr()
        )

    def current_source(self) -> torch.Tensor:
        """The registered sharded parameter's local data (after a replacement)."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if current is not None and current is not self.unsharded_param:
            if not isinstance(current, DTensor):
                raise AssertionError(
                    f"{self.fqn}: expected a DTensor parameter, got {type(current).__name__}"
                )
            self.sharded_param = current
        return local_of(self.sharded_param)

    @property
    def requires_grad(self) -> bool:
        """Follows the sharded parameter, so freezing it after fully_shard works."""
        return self.sharded_param.requires_grad

    def register_sharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.sharded_param

    def register_unsharded(self) -> None:
        if self.unsharded_param is None:
            raise AssertionError(f"{self.fqn}: unsharded parameter was never created")
        for module, name in self.owners:
            module._parameters[name] = self.unsharded_param

    # ---- unsharded side -----------------------------------------------------
    def ensure_unsharded(self, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
        """The unsharded parameter with storage allocated (contents undefined)."""
        p = self.unsharded_param
        if p is None or p.dtype != dtype or p.device != device or p.is_inference():
            # Never an inference tensor, even when first gathered under
            # torch.inference_mode(): it is reused by later training steps.
            with torch.inference_mode(False):
                t = torch.empty(self.full_shape, dtype=dtype, device=device)
                p = nn.Parameter(t, requires_grad=self.requires_grad)
            self.unsharded_param = p
        else:
            alloc_storage(p)
            if p.requires_grad != self.requires_grad:
                p.requires_grad_(self.requires_grad)
        return p

    def free_unsharded(self) -> None:
        if self.unsharded_param is not None:
            free_storage(self.unsharded_param)

    def shard_grad(self, grad_shard: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Install (or accumulate) this rank's reduced, unpadded gradient chunk
        as the DTensor ``.grad`` of the sharded parameter, in ``dtype`` (Default:
        ``None``: the parameter's own dtype)."""
        dtype = dtype or self.orig_dtype
        if grad_shard.dtype != dtype or grad_shard.device != self.sharded_data.device:
            # Offloaded shards take their gradients on the host. Blocking: an
            # async device-to-host copy could be read by the optimizer too early.
            grad_shard = grad_shard.to(self.sharded_data.device, dtype)
        existing = self.sharded_param.grad
        if existing is not None:
            local = existing._local_tensor if isinstance(existing, DTensor) else existing
            local.add_(grad_shard)
            return
        with torch.no_grad():
            grad = self._as_dtensor(grad_shard)
            if grad.dtype == self.sharded_param.dtype:
                self.sharded_param.grad = grad
            else:
                # `.grad =` refuses another dtype; `.grad.data =` allows it
                # (what FSDP1's keep_low_precision_grads does too).
                self.sharded_param.grad = torch.zeros_like(self.sharded_param)
                self.sharded_param.grad.data = grad
