"""One parameter between its sharded form (a DTensor over the mesh, what the
optimizer and state dicts see) and its unsharded form (a plain parameter that
exists only while its module computes)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from enum import Enum, auto
import inspect
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
import torch.utils.dlpack
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

import shardwise.observe as observe
from shardwise.comm import all_gather_tensor
from shardwise.errors import ConfigError, ConfigTypeError, ExtensionError, UnsupportedError, UsageError
from shardwise.layout import ShardLayout
from shardwise.mesh import MeshInfo, join_meshes


class ShardedState(Enum):
    """Where a parameter group's data lives right now."""

    SHARDED = auto()  # only the shards exist
    SHARDED_POST_FORWARD = auto()  # shards over a smaller group (reshard_after_forward=int)
    UNSHARDED = auto()  # the full parameters exist and are registered on the modules


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def make_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size
) -> DTensor:
    """A DTensor over ``local`` with the given global ``shape`` (contiguous
    strides), built directly from its spec: no communication, no autograd."""
    spec = DTensorSpec(
        mesh, tuple(placements), tensor_meta=TensorMeta(shape, _contiguous_stride(shape), local.dtype)
    )
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def sharded_spec(
    info: MeshInfo, shard_dim: int, tp_spec: DTensorSpec | None
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a sharded parameter. See [Note: tensor-parallel
    parameters]."""
    if tp_spec is None:
        if info.spmd_mesh is not None:
            raise ConfigError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
                "(e.g. from distribute_module / parallelize_module); found a plain tensor. "
                "Distribute it (Replicate() on the data-parallel dims) first."
            )
        user = info.spec_mesh
        mesh = user if user is not None and user.ndim == info.mesh.ndim else info.mesh
        return mesh, info.placements(shard_dim)
    split = tp_spec.num_shards_map[shard_dim]
    fsdp: Placement = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    if info.spmd_mesh is not None:  # dp_mesh_dims: the parameter is on the whole mesh already
        # (equal meshes are accepted: DTensor's caches may hand back an equal
        # mesh object made earlier)
        if tp_spec.mesh != info.spmd_mesh:
            raise ConfigError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
                f"different mesh objects ({tp_spec.mesh} and {info.spmd_mesh}): with dp_mesh_dims, "
                "distribute the parameters on the mesh given to fully_shard."
            )
        placements = list(tp_spec.placements)
        for i in info.spmd_dp_dims:
            if not isinstance(placements[i], Replicate):
                names = info.spmd_mesh.mesh_dim_names or ()
                raise ConfigError(
                    f"Expected Replicate() on DP {'shard' if i == info.spmd_shard_dim else 'replicate'} dim "
                    f"{names[i]!r} (index {i}) but got {placements[i]}: "
                    "with dp_mesh_dims, parameters must be Replicate() on the data-parallel mesh "
                    "dims. Distribute them with Replicate() there and let fully_shard shard them."
                )
        if info.replicate_only:  # dp_mesh_dims replicating only (DDP): placements unchanged
            return info.spmd_mesh, tuple(placements)
        # split: TP shards on the same dim to the right of the dp dim.
        split = 1
        for j in range(info.spmd_shard_dim + 1, len(placements)):
            pj = placements[j]
            if isinstance(pj, Shard) and pj.dim == shard_dim:
                split *= info.spmd_mesh.size(j)
        placements[info.spmd_shard_dim] = (
            _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        )
        return info.spmd_mesh, tuple(placements)
    if len(tp_spec.placements) > 2:
        raise UnsupportedError(
            f"fully_shard supports parameters on a 1-D or 2-D model-parallel mesh, not "
            f"{tp_spec.placements}."
        )
    if info.spec_mesh is not None and info.spec_mesh.ndim < info.mesh.ndim:
        # the wrapper's NO_SHARD over the user's 1-D mesh (the engine's is a
        # (replicate, 1) mesh of its own): replicated over the user's
        return join_meshes(info.spec_mesh, tp_spec.mesh), (Replicate(), *tp_spec.placements)
    mesh = join_meshes(info.mesh, tp_spec.mesh)
    dp = (Replicate(), fsdp) if info.replicate_group is not None else (fsdp,)
    return mesh, (*dp, *tp_spec.placements)


# Set on each temporary gathered parameter: the ShardedParam it belongs to
# (an optimizer that captured one is given the sharded parameter instead).
GATHERED_FROM = "_shardwise_gathered_from"


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a view into a larger buffer) as a tensor over the same memory
    whose storage is exactly its span. See [Note: shards with a storage of
    their own]."""
    if type(view) is not torch.Tensor or view.device.type == "meta":
        return view
    if view.storage_offset() == 0 and (
        view.numel() == 0 or view.untyped_storage().nbytes() == view.numel() * view.element_size()
    ):
        return view
    return torch.utils.dlpack.from_dlpack(view.detach())


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (typed access to ``_local_tensor``)."""
    local: torch.Tensor = cast(DTensor, t)._local_tensor
    return local


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same address: ``data_ptr``
    equality (shards re-wrapped through DLPack have storages of their own over
    the flat buffer's memory); fake tensors (the planner's), which have no
    addresses, compare storage and offset."""
    if isinstance(a, FakeTensor) or isinstance(b, FakeTensor):
        return (
            a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and a.storage_offset() == b.storage_offset()
        )
    return a.data_ptr() == b.data_ptr()


def free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    old = storage.size()
    if old != 0:
        storage.resize_(0)
        if observe.observing():
            observe.storage_resized(storage, old)


def alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    old = storage.size()
    if old != nbytes:
        storage.resize_(nbytes)
        if observe.observing():
            observe.storage_resized(storage, old)


def set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>``. Straight into ``_parameters``
    (the hot path: twice per group per step) unless the module's class
    overrides ``__setattr__``, as RNNs do to keep ``_flat_weights`` in step
    with their parameters: then through ``setattr``, so it sees each swap."""
    if type(module).__setattr__ is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


class ShardedParam:
    """One managed parameter.

    ``sharded_param`` (a DTensor ``nn.Parameter``) is the source of truth; its
    local tensor shares memory with ``sharded_data``, this rank's chunk padded
    to the chunk size (itself usually a view into the group's one flat buffer,
    so the all-gather needs no copy-in). ``unsharded_param`` is the parameter the
    module computes with; its storage is allocated only while unsharded; the
    tensor object itself persists so that autograd's saved references stay
    valid across reshard and re-unshard.

    [Note: tensor-parallel parameters]
    A parameter that is already a DTensor (tensor parallel, or a whole SPMD
    mesh with ``dp_mesh_dims``) is sharded on its *local* tensor: FSDP chunks
    what this rank holds for TP (``full_shape``), the sharded DTensor lives on
    the data-parallel mesh joined with the TP mesh and carries both placements
    (a ``_StridedShard`` on dp when TP already shards the same dim), and the
    unsharded parameter is a DTensor with the original TP placements, so the
    module's TP forward runs unchanged. Gradients are redistributed to the TP
    placements and their local tensors reduce-scattered over dp.

    [Note: all-gather extensions]
    A local tensor that defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
    (PyTorch's contract, e.g. torchao's float8 weights) is gathered through
    them: the pre-hook returns the tensors to send (e.g. fp8 data + scales) and
    metadata, the engine all-gathers exactly those into buffers kept per
    parameter (``extension_outputs``), and the post-hook builds the unsharded
    parameter from them the first time and refills it (``out=``) afterwards.

    [Note: shards with a storage of their own]
    The local tensor of a DTensor must start its storage (storage offset 0),
    as each of PyTorch's own shards does, being allocated apart. A DTensor
    takes its local tensor's storage offset (torch >= 2.10), and
    ``Tensor.__deepcopy__`` recognises a storage-less wrapper subclass only by
    ``data_ptr() == 0``, which a non-zero offset breaks: ``copy.deepcopy`` of
    a state dict then copies the wrapper's invalid storage ("Attempted to call
    copy_() on an invalid python storage"), and every detached or derived
    DTensor inherits the offset. So a shard viewing the flat buffer at an
    offset is handed to its DTensor re-wrapped through DLPack: the same memory
    (the optimizer's in-place steps reach the all-gather input), a storage of
    exactly its own span (so ``torch.save`` writes only the shard too) that
    keeps the flat buffer alive.
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
        # The original DTensor layout (TP / SPMD parameters); None for plain tensors.
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        local_param = local_of(param) if isinstance(param, DTensor) else param
        self.global_shape = param.shape  # what DTensors and state dicts show
        self.full_shape = local_param.shape  # what FSDP chunks (TP-local for DTensors)
        self.layout = ShardLayout.make(self.full_shape, shard_dim, info.shard_size, info.shard_rank)
        self.spmd_mesh, self.spmd_placements = sharded_spec(info, shard_dim, self.tp_spec)
        self.has_extensions = False
        self.check_extensions(local_param)
        # Filled by ParamGroup._init_storage (and again when shards are replaced).
        self.sharded_data: torch.Tensor = torch.empty(0)
        self._adopted_local: torch.Tensor | None = None  # the local shard adopt_storage made
        self.sharded_param: nn.Parameter = param
        # Only for building the first DTensor; never keep the full tensor alive.
        self._initial_requires_grad = param.requires_grad
        # Lazily created at first unshard, in the all-gather dtype.
        self.unsharded_param: nn.Parameter | None = None
        # Whether the unsharded parameter views its group's shared buffer.
        self._in_group_buffer = False
        # Grad DTensor specs by dtype (built once: gradients are installed every step).
        self._grad_specs: dict[torch.dtype, DTensorSpec] = {}
        # Gradients accumulated while sync is off, kept in the reduce dtype.
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        # All-gather extensions: per-parameter gathered buffers (reused: the
        # unsharded parameter may alias them), the post-hook's inner tensors
        # (freed at reshard) and this gather's metadata and input shapes.
        self.extension_outputs: list[torch.Tensor] = []
        self.extension_inner: tuple[torch.Tensor, ...] = ()
        self.extension_metadata: Any = None
        self.extension_sizes: list[torch.Size] = []
        self.extension_dtypes: list[torch.dtype] = []

    # ---- sharded side -------------------------------------------------------
    @torch.no_grad()  # the copy must not tie the shard buffer to the source's graph
    def adopt_storage(self, padded: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (a full tensor or this rank's local chunk) into
        ``padded`` and (re)build the DTensor parameter over it."""
        rows = self.layout.local_rows
        local = padded.narrow(self.shard_dim, 0, rows)
        if isinstance(source, DTensor):
            source = local_of(source)
        if local.device.type != "meta":
            if source.shape == self.full_shape and self.layout.num_shards > 1:
                source = self._chunk_of(source)
            if source.device.type != "meta" and rows:
                local.copy_(source)
            if self.layout.chunk > rows:
                padded.narrow(self.shard_dim, rows, self.layout.chunk - rows).zero_()
        local = own_storage(local)  # [Note: shards with a storage of their own]
        self.sharded_data = padded
        self._adopted_local = local
        current = self.sharded_param
        if (
            isinstance(current, DTensor)
            and current._local_tensor.shape == local.shape
            and current.device_mesh == self.spmd_mesh
            and tuple(current.placements) == self.spmd_placements
        ):
            # Keep the same Parameter object (optimizers may already hold it).
            current._local_tensor = local
        else:
            self.sharded_param = nn.Parameter(self._as_dtensor(local), requires_grad=self._initial_requires_grad)
            # (nn.Parameter detaches: its local tensor is another object over
            # the same memory, the one an empty shard is recognised by. Its
            # mesh may be another object, equal to ours, from DTensor's
            # propagation cache: gradients take the parameter's, as PyTorch's.)
            self._adopted_local = local_of(self.sharded_param)
            self._grad_specs.clear()
        self.register_sharded()

    def _chunk_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the full ``full``: a narrowed view; for a tensor
        subclass (torchao's NF4 and int8 training weights), what
        ``torch.chunk`` gives, as PyTorch's fully_shard cuts them: such types
        implement the split it dispatches, not always an arbitrary slice."""
        if type(full) in (torch.Tensor, nn.Parameter):
            return self.layout.local_chunk(full)
        chunks = torch.chunk(full, self.layout.num_shards, dim=self.shard_dim)
        return chunks[self.layout.rank] if self.layout.rank < len(chunks) else full.new_empty(0)

    @torch.no_grad()
    def gather_chunks(self, local: torch.Tensor) -> torch.Tensor:
        """The whole of what FSDP cuts (the TP-local tensor of a
        tensor-parallel parameter, else the full one) from ``local``, this
        rank's unpadded chunk of it (the parameter's, its gradient's or an
        optimizer state's): gathered over the shard group alone (replicas
        hold the same chunks; tensor parallelism's dims stay cut). A
        collective over the shard group."""
        layout = self.layout
        if layout.num_shards == 1:  # (NO_SHARD) this rank holds it whole
            return local.clone()
        padded = local.new_zeros(layout.padded_shape)
        padded.narrow(layout.dim, 0, local.size(layout.dim)).copy_(local)
        gathered = local.new_empty((layout.num_shards, *layout.padded_shape))
        all_gather_tensor(gathered, padded, self.info.shard_group)
        whole = local.new_empty(self.full_shape)
        layout.gather_into(whole, gathered)
        return whole

    def as_unwrapped(self, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` (what :meth:`gather_chunks` gives) as the module held it
        before sharding: on the TP mesh with its TP placements for a
        tensor-parallel parameter (as FSDP1's full state dicts and
        ``summon_full_params`` show it), else as it is."""
        if self.tp_spec is None:
            return whole
        return make_dtensor(whole, self.tp_spec.mesh, self.tp_spec.placements, self.global_shape)

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap this rank's (unpadded) chunk as a DTensor of the global shape
        (its spec built once per dtype). Outside a compiled region only
        ``DTensor.__new__`` runs: ``DTensor.__init__`` does nothing but carry
        dynamo's and export's decorators, whose wrappers cost more than the
        construction itself (3.5 against 1.2 us a call timed alone; 17 against
        6 us in the backward, line-profiled), once per gradient per step."""
        spec = self._grad_specs.get(local.dtype)
        if spec is None:
            current, mesh = self.sharded_param, self.spmd_mesh
            if isinstance(current, DTensor) and current.device_mesh == mesh:
                mesh = current.device_mesh  # the parameter's own object (see adopt_storage)
            spec = make_dtensor(local, mesh, self.spmd_placements, self.global_shape)._spec
            self._grad_specs[local.dtype] = spec
        if torch.compiler.is_compiling():
            return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return DTensor.__new__(DTensor, local, spec, requires_grad=False)

    def local_is_adopted(self) -> bool:
        """Whether the registered DTensor still views ``sharded_data`` (false after
        ``to_empty`` / ``_apply`` / ``load_state_dict(assign=True)`` replaced it)."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if self._parametrized_away(current):
            return False  # current_source says so
        if current is not self.sharded_param and current is not self.unsharded_param:
            return False
        local = local_of(self.sharded_param)
        return (
            local.device == self.sharded_data.device
            and local.dtype == self.sharded_data.dtype
            and local.device.type != "meta"
            # An empty shard (all padding on this rank) has no memory to compare
            # (re-wrapped, its address is 0): it is adopted while it is the tensor
            # adopted. Otherwise this rank alone would re-adopt, and reshard, and
            # its collectives would no longer match the other ranks'.
            and (local is self._adopted_local if local.numel() == 0 else _same_memory(local, self.sharded_data))
        )

    def shard_place(self) -> tuple[torch.UntypedStorage, int]:
        """The storage and element offset of this rank's local shard (the
        sharded parameter's local tensor, a storage of its own over the flat
        buffer's memory, see [Note: shards with a storage of their own])."""
        local = self._adopted_local if self._adopted_local is not None else self.sharded_data
        return local.untyped_storage(), int(local.storage_offset())

    def _parametrized_away(self, current: object) -> bool:
        """Whether a parametrization registered after fully_shard moved the
        sharded parameter off its module (``current``: what is registered)."""
        module, name = self.owners[0]
        return current is None and parametrize.is_parametrized(module, name)

    def current_source(self) -> torch.Tensor:
        """The registered sharded parameter's local data (after a replacement)."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if self._parametrized_away(current):
            raise UsageError(
                f"Parameter {self.fqn!r}: a parametrization was registered on it after fully_shard, which "
                "moved the sharded parameter where fully_shard no longer gathers it. "
                "Register parametrizations (weight_norm, spectral_norm, orthogonal, "
                "register_parametrization) before fully_shard: it then shards their original tensors."
            )
        if current is not None and current is not self.unsharded_param:
            if not isinstance(current, DTensor):
                raise ConfigTypeError(
                    f"{self.fqn} is now a {type(current).__name__} where fully_shard registered a sharded "
                    "DTensor parameter (replaced by assignment, load_state_dict(assign=True) or "
                    "torch.func.functional_call before the first forward?). Replace it with a DTensor on the "
                    "same mesh and placement (distribute_tensor), or copy values in with load_state_dict."
                )
            self.sharded_param = current
        return local_of(self.sharded_param)

    @property
    def requires_grad(self) -> bool:
        """Follows the sharded parameter, so freezing it after fully_shard works."""
        return self.sharded_param.requires_grad

    def register_sharded(self) -> None:
        for module, name in self.owners:
            set_param(module, name, self.sharded_param)

    def register_unsharded(self) -> None:
        if self.unsharded_param is None:
            raise AssertionError(f"{self.fqn}: unsharded parameter was never created")
        for module, name in self.owners:
            set_param(module, name, self.unsharded_param)

    # ---- unsharded side -----------------------------------------------------
    def unsharded_local(self) -> torch.Tensor:
        """The plain tensor holding the unsharded data (a TP DTensor's local),
        as a ``.data`` alias: gathering into it must not bump the version of
        what autograd saved (a compiled graph saves a TP DTensor's local)."""
        p = self.unsharded_param
        if p is None:
            raise AssertionError(f"{self.fqn}: unsharded parameter was never created")
        return local_of(p).data if isinstance(p, DTensor) else p.data

    def ensure_unsharded(
        self,
        dtype: torch.dtype,
        device: torch.device,
        storage: torch.UntypedStorage | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """Allocate the unsharded parameter's storage and return the plain tensor
        to gather into (contents undefined). With ``storage`` (the group's one
        buffer), create the parameter anew over it at element ``offset``: a
        tensor of its own (own autograd version counter) sharing the storage."""
        p = self.unsharded_param
        if (
            storage is not None or self._in_group_buffer or p is None or p.dtype != dtype
            or p.device != device or p.is_inference()
        ):
            # Never an inference tensor, even when first gathered under
            # torch.inference_mode(): it is reused by later training steps.
            with torch.inference_mode(False):
                if storage is None:
                    t = torch.empty(self.full_shape, dtype=dtype, device=device)
                else:
                    t = torch.empty(0, dtype=dtype, device=device).set_(
                        storage, offset, self.full_shape, _contiguous_stride(self.full_shape)
                    )
                if self.tp_spec is not None:
                    t = make_dtensor(t, self.tp_spec.mesh, self.tp_spec.placements, self.global_shape)
                p = nn.Parameter(t, requires_grad=self.requires_grad)
                setattr(p, GATHERED_FROM, self)
            self.unsharded_param = p
            self._in_group_buffer = storage is not None
        else:
            alloc_storage(self.unsharded_local())
            if p.requires_grad != self.requires_grad:
                p.requires_grad_(self.requires_grad)
        return self.unsharded_local()

    def free_unsharded(self) -> None:
        if self.unsharded_param is None:
            return
        if self.has_extensions:
            for t in (*self.extension_inner, *self.extension_outputs):
                free_storage(t)
        else:
            free_storage(self.unsharded_local())

    # ---- all-gather extensions ----------------------------------------------
    def check_extensions(self, local: torch.Tensor | None = None) -> bool:
        """Whether the local shard (its type, or the tensor itself: PyTorch's
        tests attach the hooks to ``param.to_local()`` after ``fully_shard``)
        defines the all-gather extension hooks, as PyTorch looks them up;
        returns whether that changed."""
        if local is None:
            local = local_of(self.sharded_param)
        has = hasattr(local, "fsdp_pre_all_gather")
        if has != hasattr(local, "fsdp_post_all_gather"):
            raise ExtensionError(
                "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using all-gather "
                f"extensions: parameter {self.fqn!r} ({type(local).__name__}) defines only one."
            )
        changed, self.has_extensions = has != self.has_extensions, has
        return changed

    def extension_inputs(self, module: nn.Module, mp: Any, device: torch.device) -> list[torch.Tensor]:
        """Call ``fsdp_pre_all_gather`` on this rank's padded shard: the 1-D
        tensors to all-gather (their sizes and the metadata are kept)."""
        # Called, as PyTorch calls it, on the DTensor's own local tensor: what
        # users set on that object is seen (torchao's precomputed float8 scale,
        # hooks attached to it). A shard with padding rows (uneven, which
        # PyTorch refuses) is called on its padded buffer instead.
        local: Any = local_of(self.sharded_param)
        shard: Any = local if local.shape == self.layout.padded_shape else self.sharded_data
        if shard.device != device:
            shard = shard.to(device, non_blocking=True)
        if shard is not local and getattr(local, "_precomputed_scale", None) is not None:
            # torchao's precomputed float8 scale is the whole weight's: the
            # padded buffer's object takes it too (else its pre-hook reduces
            # an amax on this rank alone, and the ranks' collectives part)
            shard._precomputed_scale = local._precomputed_scale
        pre = getattr(shard, "fsdp_pre_all_gather", None) or getattr(local, "fsdp_pre_all_gather")
        signature = inspect.signature(pre)
        if len(signature.parameters) == 1:  # the older one-argument form
            inputs, self.extension_metadata = pre(self.info.shard_mesh)
        elif len(signature.parameters) == 5:
            inputs, self.extension_metadata = pre(
                self.info.shard_mesh, self.full_shape, _contiguous_stride(self.full_shape), module, mp
            )
        else:
            raise ExtensionError(
                f"Invalid fsdp_pre_all_gather: {signature}\nExpects fsdp_pre_all_gather(self, mesh: "
                "DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, "
                f"mp_policy: MixedPrecisionPolicy) (parameter {self.fqn!r}, {type(local).__name__})."
            )
        # Any shapes, as in PyTorch: each is gathered flat and seen by the
        # post-hook as every rank's tensor stacked on dim 0 (NF4 returns flat
        # quantized bytes and scales, not rows of the shard).
        inputs = list(inputs)
        self.extension_sizes = [t.shape for t in inputs]
        self.extension_dtypes = [t.dtype for t in inputs]
        return [t.contiguous().view(-1) for t in inputs]

    def extension_buffers(self, device: torch.device) -> list[torch.Tensor]:
        """The per-parameter gathered buffers, (re)allocated: the same tensors on
        every call, since the unsharded parameter may alias them."""
        num = self.layout.num_shards
        wanted = [(num * s.numel(), t_dtype) for s, t_dtype in zip(self.extension_sizes, self.extension_dtypes)]
        if [(t.numel(), t.dtype) for t in self.extension_outputs] != wanted:
            self.extension_outputs = [torch.empty(n, dtype=d, device=device) for n, d in wanted]
        for t in self.extension_outputs:
            alloc_storage(t)
        return self.extension_outputs

    def finish_extension(self, dtype: torch.dtype) -> None:
        """Build (first time) or refill the unsharded parameter through
        ``fsdp_post_all_gather`` from the gathered buffers."""
        outputs = tuple(
            t.view(-1, *s[1:]) for t, s in zip(self.extension_outputs, self.extension_sizes)
        )
        shard: Any = local_of(self.sharded_param)
        post = shard.fsdp_post_all_gather
        if self.unsharded_param is not None:
            for t in self.extension_inner:
                alloc_storage(t)
            # refilled in place: autograd's saved copy must not look modified
            with same_version(self.unsharded_param):
                post(outputs, self.extension_metadata, dtype, out=self.unsharded_param)
        else:
            unsharded, inner = post(outputs, self.extension_metadata, dtype)
            self.extension_inner = tuple(inner)
            # Drop the padding rows that trail the rank-major concatenation.
            unsharded = torch.as_strided(
                unsharded, self.full_shape, _contiguous_stride(self.full_shape), storage_offset=0
            )
            if self.tp_spec is not None:  # the TP-local weight, on the TP mesh again (as PyTorch)
                unsharded = make_dtensor(unsharded, self.tp_spec.mesh, self.tp_spec.placements, self.global_shape)
            self.unsharded_param = nn.Parameter(unsharded, requires_grad=self.requires_grad)
            setattr(self.unsharded_param, GATHERED_FROM, self)
        self.extension_metadata = None

    def unsharded_grad(self, refuse_grad_of_grad: bool) -> torch.Tensor | None:
        """The unsharded parameter's gradient, to be reduced: dense, and
        detached where backward(create_graph=True) made it require grad
        (PyTorch's fully_shard reduces under no_grad; FSDP1 refuses it)."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        if grad is None:
            return None
        if grad.layout != torch.strided:
            raise UnsupportedError(
                f"{self.fqn} got a {grad.layout} gradient; fully_shard reduce-scatters dense "
                "gradients only (as PyTorch's does). Use nn.Embedding(..., sparse=False), or "
                "keep that module out of fully_shard (ignored_params)."
            )
        if grad.requires_grad:
            if refuse_grad_of_grad:
                raise RuntimeError("FSDP does not support gradients of gradients")
            grad = grad.detach()
        return grad

    def grad_local(self, grad: torch.Tensor) -> torch.Tensor:
        """The plain tensor of an unsharded gradient: a TP DTensor gradient is
        first brought to the parameter's TP placements (e.g. Partial -> Replicate)."""
        if not isinstance(grad, DTensor):
            return grad
        spec = self.tp_spec
        if spec is None:
            raise AssertionError(f"{self.fqn}: DTensor gradient for a plain parameter")
        target = tuple(
            grad.placements[i] if i in self.info.spmd_dp_dims else spec.placements[i]
            for i in range(len(spec.placements))
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return local_of(grad)

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
        else:
            grad = self._as_dtensor(grad_shard)
            if grad.dtype == self.sharded_param.dtype:
                self.sharded_param.grad = grad
            else:
                # `.grad =` refuses another dtype; `.grad.data =` allows it
                # (what FSDP1's keep_low_precision_grads does too). On a
                # DTensor `.data =` changes only the outer tensor's metadata:
                # its local tensor and spec (dtype) are set to the gradient's.
                with torch.no_grad():
                    holder = torch.zeros_like(self.sharded_param)
                    self.sharded_param.grad = holder
                    holder.data = grad
                    holder._local_tensor = grad._local_tensor  # type: ignore[attr-defined]
                    holder._spec = grad._spec  # type: ignore[attr-defined]
        self.run_post_accumulate_grad_hooks()

    def run_post_accumulate_grad_hooks(self) -> None:
        """Call the sharded parameter's post-accumulate-grad hooks, as autograd
        would had it accumulated the gradient itself: the sharded parameter is
        not in the graph (its unsharded form is), so this is the only place its
        gradient is ever accumulated. PyTorch's fully_shard calls them here too
        (optimizer-in-backward steps each parameter from such a hook)."""
        if self.has_post_accumulate_grad_hooks and not torch._dynamo.compiled_autograd.in_compiled_autograd_region:
            for hook in tuple(self.sharded_param._post_accumulate_grad_hooks.values()):
                hook(self.sharded_param)

    @property
    def has_post_accumulate_grad_hooks(self) -> bool:
        return bool(getattr(self.sharded_param, "_post_accumulate_grad_hooks", None))


def step_in_backward_optimizers(params: list[ShardedParam], enabled: bool) -> None:
    """FSDP1's optimizer in backward (``enabled``: the wrapper's groups): once
    their sharded gradients are installed, every optimizer that
    ``_apply_optimizer_in_backward`` attached to a parameter steps, then its
    gradients are cleared. (That function hooks the parameter's own gradient
    accumulator, which never runs for a sharded parameter.)"""
    if not enabled:
        return
    for p in params:
        optims = getattr(p.sharded_param, "_in_backward_optimizers", None)
        if optims and p.sharded_param.grad is not None:
            for optim in optims:
                optim.step()
            for optim in optims:
                optim.zero_grad(set_to_none=True)


def same_version(t: torch.Tensor) -> AbstractContextManager[Any]:
    """Writes inside leave ``t``'s autograd version unchanged (as PyTorch's
    all-gather copy-out does); inference tensors have no version."""
    return nullcontext() if t.is_inference() else _unsafe_preserve_version_counter(t)
