"""All-gather extensions (PyTorch's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` contract for tensor-subclass parameters): the engine
all-gathers exactly what the pre-hook returns (one collective per group),
rebuilds the unsharded parameter through the post-hook (first without ``out``,
then refilling the same tensor with ``out=``), and trains like an unsharded
reference that applies the same transform to the full weight; PyTorch's own
``fully_shard`` on the same subclass makes the same calls and the same numbers;
torchao's float8 all-gather (when torchao is installed) matches PyTorch's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import return_and_correct_aliasing

from shardwise.testing import multi_rank

# torch >= 2.13's name; older torch has only all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# ---- the subclasses ----------------------------------------------------------

# (kind, out) per post-hook call, and the tensors each pre-hook returned.
_POST_CALLS: list[tuple[str, torch.Tensor | None]] = []
_PRE_DTYPES: list[tuple[torch.dtype, ...]] = []


class _Wrapped(torch.Tensor):
    """A wrapper subclass over one plain tensor ``_data``: every op runs on
    ``_data`` and tensor results are wrapped again (as TwoTensor does), so
    chunk / new_zeros / narrow / copy_ / optimizer steps keep the subclass."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self):
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        unwrapped = pytree.tree_map_only(_Wrapped, lambda t: t._data, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        wrapped = pytree.tree_map_only(torch.Tensor, cls, out)
        return return_and_correct_aliasing(func, args, kwargs, wrapped)

    @staticmethod
    def _padded(data: torch.Tensor, mesh, outer_size) -> torch.Tensor:
        """This rank's rows padded to FSDP's chunk size: PyTorch calls the
        pre-hook on the unpadded local shard, shardwise on the padded one."""
        rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] == rows:
            return data
        pad = data.new_zeros(rows - data.shape[0], *data.shape[1:])
        return torch.cat([data, pad])


class BF16GatherTensor(_Wrapped):
    """Gathers its data cast to bfloat16; the unsharded parameter is a plain
    tensor in param_dtype holding the bf16-rounded values."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        sent = (self._padded(self._data, mesh, outer_size).to(torch.bfloat16),)
        _PRE_DTYPES.append(tuple(t.dtype for t in sent))
        return sent, None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if out is not None:
            _POST_CALLS.append(("out", out))
            if out.data_ptr() != data.data_ptr():  # a copy (float32), else it aliases the buffer
                out.data.copy_(data[: out.shape[0]])  # .data: autograd's saved weight keeps its version
            return None
        _POST_CALLS.append(("new", None))
        full = data.to(param_dtype)  # bf16 compute (param_dtype): the gathered buffer itself
        return full, (full,)


class BF16GatherTensorOldHook(BF16GatherTensor):
    """The older one-argument pre-hook (what torchao's float8 weights define)."""

    def fsdp_pre_all_gather(self, mesh):
        sent = (self._data.to(torch.bfloat16),)  # even shapes only: no outer size to pad to
        _PRE_DTYPES.append(tuple(t.dtype for t in sent))
        return sent, None


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and a float32 scale per row."""
    scale = w.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-8) / 127
    q = torch.round(w.detach().float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


class Int8RowGatherTensor(_Wrapped):
    """Gathers two tensors: int8 data and a per-row float32 scale."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        sent = _quantize_rows(self._padded(self._data, mesh, outer_size))
        _PRE_DTYPES.append(tuple(t.dtype for t in sent))
        return sent, None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        q, scale = outputs
        if out is not None:
            _POST_CALLS.append(("out", out))
            rows = out.shape[0]
            out.data.copy_(_dequantize_rows(q[:rows], scale[:rows]))
            return None
        _POST_CALLS.append(("new", None))
        full = _dequantize_rows(q, scale).to(param_dtype)
        return full, (full,)


# ---- the reference's transforms (straight-through: identity gradient) -------


class _RoundBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.to(torch.bfloat16).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


class _QuantRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return _dequantize_rows(*_quantize_rows(w)).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


_REF_TRANSFORM = {BF16GatherTensor: _RoundBF16.apply, BF16GatherTensorOldHook: _RoundBF16.apply,
                  Int8RowGatherTensor: _QuantRows.apply}


# ---- the model -----------------------------------------------------------------


class Lin(nn.Module):
    """A linear layer whose weight the reference transforms like the
    extension does; records the weight tensor each forward computes with."""

    def __init__(self, n_in, n_out, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1) if bias else None
        self.transform = None  # set on the reference only
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        w = self.weight
        if self.transform is not None:
            w = self.transform(w)
        else:
            self.seen.append(w)
        return F.linear(x, w, self.bias)


class Net(nn.Module):
    """Blocks of bias-free layers (groups holding subclass weights only) and a
    head with a plain bias (a group mixing extension and plain parameters).
    ``sizes`` gives uneven row counts so that FSDP pads."""

    def __init__(self, sizes=(16, 16, 16), head=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(Lin(a, b, bias=False), nn.Tanh()) for a, b in zip(sizes, sizes[1:])
        )
        self.head = Lin(sizes[-1], head, bias=True)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def lins(self):
        return [m for m in self.modules() if isinstance(m, Lin)]


def _build(cls, sizes, seed=0):
    """(model with ``cls`` weights, unsharded reference with plain weights)."""
    torch.manual_seed(seed)
    ref = Net(sizes)
    model = copy.deepcopy(ref)
    for lin in model.lins():
        lin.weight = nn.Parameter(cls(lin.weight.detach().clone()))
    for lin in ref.lins():
        lin.transform = _REF_TRANSFORM[cls]
    return model, ref


def _shard(model, fully_shard, mesh=None, **kw):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _x(step, dim):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(6, dim, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a Shard(0) DTensor whose local may be one of our
    subclasses (gathered as plain tensors, since DTensor's collectives would
    run through the subclass)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t._data if isinstance(t, _Wrapped) else t
    local = t._local_tensor
    local = (local._data if isinstance(local, _Wrapped) else local).detach().clone()
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return torch.cat(parts)


def _train(model, steps, dim, *, ref=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    outs = []
    for step in range(steps):
        y = model(_x(step, dim))
        y.square().mean().backward()
        if ref:
            from shardwise.testing import replicate_grads

            replicate_grads(model)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        outs.append((y.detach().clone(), grads))
    return outs


def _compare(model, ref, outs, ref_outs, exact=False):
    close = (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg)) if exact else (
        lambda a, b, msg: torch.testing.assert_close(a, b, msg=msg)
    )
    for step, ((y, g), (ry, rg)) in enumerate(zip(outs, ref_outs)):
        close(y, ry, f"output, step {step}")
        assert g.keys() == rg.keys()
        for n in g:
            assert g[n].dtype == rg[n].dtype == torch.float32, n
            close(g[n], rg[n], f"grad {n}, step {step}")
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        close(_full(p.detach()), _full(ref_params[n].detach()), f"param {n}")


def _train_like_reference(model, ref, steps, dim):
    """Train ``model`` and ``ref`` ``steps`` steps (hook records cleared first)
    and compare outputs, gradients and parameters."""
    _POST_CALLS.clear()
    _PRE_DTYPES.clear()
    outs = _train(model, steps, dim)
    _compare(model, ref, outs, _train(ref, steps, dim, ref=True))


class _RecordingAllGather:
    """A shardwise AllGather that records what each call sends."""

    def __new__(cls):
        from shardwise import AllGather

        class Recording(AllGather):
            def __init__(self):
                self.sent: list[tuple[torch.dtype, int]] = []

            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                self.sent.append((input_tensor.dtype, input_tensor.numel()))
                return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)

        return Recording()


# ---- tests ---------------------------------------------------------------------------


@multi_rank(world_sizes=(1, 2, 4))
def test_bf16_gather_trains_like_a_bf16_rounded_reference(world_size):
    """The engine gathers the bf16 the pre-hook returns (never the float32
    shard), builds the parameter once without ``out`` and refills that same
    tensor with ``out=`` on every later unshard; training matches a reference
    whose forward uses bf16-rounded weights."""
    from shardwise import fully_shard

    sizes = (16, 24, 16)
    model, ref = _build(BF16GatherTensor, sizes)
    _shard(model, fully_shard)
    comms = {}
    for name, m in (("block0", model.blocks[0]), ("block1", model.blocks[1]), ("root", model)):
        comms[name] = _RecordingAllGather()
        m.set_custom_all_gather(comms[name])
    steps = 4
    _train_like_reference(model, ref, steps, sizes[0])

    # What went over the wire: bf16 for the subclass weights (2 bytes each).
    assert set(_PRE_DTYPES) == {(torch.bfloat16,)}
    chunk = lambda rows: -(-rows // world_size)  # noqa: E731
    for i, name in enumerate(("block0", "block1")):
        n_out, n_in = sizes[i + 1], sizes[i]
        # Blocks reshard after forward: one gather in forward, one in backward.
        assert comms[name].sent == [(torch.bfloat16, chunk(n_out) * n_in)] * (2 * steps), comms[name].sent
    # The root group holds a bf16-gathered weight beside its plain float32 bias:
    # one packed collective of bytes per step (the root keeps its parameters).
    head = model.head
    weight_bytes = chunk(head.weight.shape[0]) * head.weight.shape[1] * 2
    bias_bytes = chunk(head.bias.shape[0]) * 4
    root = comms["root"].sent
    assert len(root) == steps and {dt for dt, _ in root} == {torch.uint8}, root
    for _, nbytes in root:
        assert weight_bytes + bias_bytes <= nbytes <= weight_bytes + bias_bytes + 2 * 16, (nbytes, weight_bytes)
        assert nbytes < 2 * weight_bytes + bias_bytes  # a float32 weight would not fit

    # Post-hook: once without out per parameter, then out= the same tensor.
    lins = model.lins()
    assert [k for k, _ in _POST_CALLS].count("new") == len(lins)
    assert _POST_CALLS[: len(lins)] == [("new", None)] * len(lins)  # all in the first forward
    outs_given = [o for k, o in _POST_CALLS if k == "out"]
    assert len(outs_given) == (2 * steps - 1) * 2 + (steps - 1)
    for lin in lins:
        assert len(lin.seen) == steps and all(w is lin.seen[0] for w in lin.seen), lin
        assert type(lin.seen[0]) is nn.Parameter and lin.seen[0].dtype == torch.float32
    assert {id(o) for o in outs_given} == {id(lin.seen[0]) for lin in lins}


@multi_rank(world_sizes=(1, 2, 4))
def test_int8_with_row_scales_trains_like_a_quantised_reference(world_size):
    """Two tensors per parameter (int8 data + a float32 scale per row), over
    row counts that do not divide by the world size (padding, and at 4 ranks
    an empty shard): the same numbers as a reference quantising the full weight."""
    from shardwise import fully_shard

    sizes = (8, 10, 6, 3)
    model, ref = _build(Int8RowGatherTensor, sizes)
    _shard(model, fully_shard)
    comm = _RecordingAllGather()
    model.blocks[1].set_custom_all_gather(comm)
    steps = 3
    _train_like_reference(model, ref, steps, sizes[0])
    assert set(_PRE_DTYPES) == {(torch.int8, torch.float32)}
    # Block 1's weight (6 x 10): int8 rows + one float32 scale per row, packed as bytes.
    rows = -(-6 // world_size)
    assert {dt for dt, _ in comm.sent} == {torch.uint8}
    for _, nbytes in comm.sent:
        assert rows * 10 + rows * 4 <= nbytes <= rows * 10 + rows * 4 + 2 * 16
    assert [k for k, _ in _POST_CALLS].count("new") == len(model.lins())


@multi_rank(world_sizes=(2,))
def test_one_argument_pre_hook():
    """The older ``fsdp_pre_all_gather(self, mesh)`` form is still called."""
    from shardwise import fully_shard

    sizes = (8, 8, 8)
    model, ref = _build(BF16GatherTensorOldHook, sizes)
    _shard(model, fully_shard)
    _PRE_DTYPES.clear()
    outs = _train(model, 2, sizes[0])
    ref_outs = _train(ref, 2, sizes[0], ref=True)
    _compare(model, ref, outs, ref_outs)
    assert _PRE_DTYPES and set(_PRE_DTYPES) == {(torch.bfloat16,)}


@pytest.mark.parametrize(
    "cls,bf16", [("BF16GatherTensor", False), ("BF16GatherTensor", True), ("Int8RowGatherTensor", False)]
)
@multi_rank(world_sizes=(2, 4))
def test_same_calls_and_numbers_as_pytorch(cls, bf16):
    """PyTorch's fully_shard on the same subclass: the same post-hook calls
    (without, then with ``out``), the same outputs, gradients and parameters.
    With param_dtype=bf16 the unsharded weight is the gathered buffer itself,
    refilled in place on every unshard."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard as sw_fully_shard

    cls = globals()[cls]
    # PyTorch's fully_shard refuses uneven shards of an extension whose inputs
    # differ in shape (the int8 data and its per-row scales): even rows there.
    sizes = (8, 12, 8, 4) if cls is Int8RowGatherTensor else (8, 10, 6, 3)
    runs = {}
    for name, fs in (("shardwise", sw_fully_shard), ("torch", pt_fully_shard)):
        model, _ = _build(cls, sizes)
        _shard(model, fs, **_mp(name, bf16))
        _POST_CALLS.clear()
        _PRE_DTYPES.clear()
        outs = _train(model, 3, sizes[0])
        calls = [k for k, _ in _POST_CALLS]
        runs[name] = (model, outs, calls, list(_PRE_DTYPES))
    (sw, sw_outs, sw_calls, sw_pre), (pt, pt_outs, pt_calls, pt_pre) = runs["shardwise"], runs["torch"]
    assert sw_calls == pt_calls and sw_pre == pt_pre
    _compare(sw, pt, sw_outs, [(y, g) for y, g in pt_outs], exact=True)


def _mp(name, bf16):
    """fully_shard's mp_policy keyword for shardwise or PyTorch (none unless ``bf16``)."""
    if not bf16:
        return {}
    if name == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy
    else:
        from shardwise import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}


class _BytesAllGather:
    """PyTorch's fully_shard on gloo needs this for float8 (gloo has no float8
    type): the same all-gather over a uint8 view."""

    def __new__(cls):
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

        class BytesAllGather(AllGather):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                if output_tensor.dtype.itemsize == 1:
                    output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
                return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)

        return BytesAllGather()


@multi_rank(world_sizes=(1, 2, 4))
def test_torchao_float8_all_gather_matches_pytorch(world_size):
    """torchao's Float8Linear with enable_fsdp_float8_all_gather: float8 data
    gathered (as bytes on gloo) and the same numbers as PyTorch's fully_shard."""
    pytest.importorskip("torchao")
    from torch.distributed.fsdp import fully_shard as pt_fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from shardwise import fully_shard as sw_fully_shard

    runs = {}
    for name, fs in (("shardwise", sw_fully_shard), ("torch", pt_fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.ReLU(), nn.Linear(48, 16, bias=False))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        for m in (model[0], model[2], model):
            fs(m)
        assert type(model[0].weight.to_local()) is WeightWithDynamicFloat8CastTensor
        if name == "torch":
            for m in (model[0], model[2]):
                m.set_custom_all_gather(_BytesAllGather())
        runs[name] = _record_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 32)
    _assert_bit_equal(runs)


def _record_steps(model, opt, dim, reseed=False):
    """Three steps on ``_x``: each output and the full gradients. ``reseed``:
    the same RNG state before each optimizer step (for stochastic rounding)."""
    outs = []
    for step in range(3):
        y = model(_x(step, dim))
        y.float().square().mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        if reseed:
            torch.manual_seed(99 + step)
        opt.step()
        opt.zero_grad()
        outs.append((y.detach(), grads))
    return outs


def _assert_bit_equal(runs):
    for (y, g), (ry, rg) in zip(runs["shardwise"], runs["torch"]):
        torch.testing.assert_close(y, ry, rtol=0, atol=0)
        assert g.keys() == rg.keys() and g
        for n in g:
            torch.testing.assert_close(g[n], rg[n], rtol=0, atol=0)


@multi_rank(world_sizes=(3,))
def test_torchao_precomputed_float8_scale_with_uneven_shards():
    """Uneven shards (64 rows over 3 ranks: 22, 22, 20), which PyTorch's
    fully_shard cannot gather for extensions: the last rank's pre-hook runs
    on its padded buffer, which must take torchao's precomputed scale too.
    Without it that rank alone all-reduced an amax, and every rank hung.
    Precomputed or not, the numbers are the same."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from shardwise import fully_shard

    runs = {}
    for precompute in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(96, 64, bias=False), nn.ReLU(), nn.Linear(64, 96, bias=False))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
        for m in (model[0], model[2], model):
            fully_shard(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            loss = model(_x(step, 96)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                precompute_float8_dynamic_scale_for_fsdp(model)
            losses.append(loss.item())
        runs[precompute] = losses
    assert runs[True] == runs[False], runs


class _QLoRALinear(nn.Module):
    """torchtune's QLoRA linear, in small: a frozen NF4 weight (torchao) and
    trainable low-rank adapters."""

    def __init__(self, d_in, d_out):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in), 64, 32), requires_grad=False)
        self.lora_a = nn.Linear(d_in, 4, bias=False)
        self.lora_b = nn.Linear(4, d_out, bias=False)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


@pytest.mark.parametrize("kind", ["nf4_qlora", "int8_training"])
@multi_rank(world_sizes=(2,))
def test_torchao_quantized_weights_train_like_pytorch(kind):
    """torchao's other all-gather extensions: NF4 weights (QLoRA) and int8
    weight-only training. PyTorch cuts such a weight with torch.chunk and
    never zeroes it; shardwise narrowed it (NF4 has no arbitrary slice) and
    zeroed its empty padding (int8 has no zero_), and fully_shard failed.
    NF4's pre-hook returns flat quantized bytes and scales, not rows."""
    pytest.importorskip("torchao")
    from torch.distributed.fsdp import fully_shard as pt_fully_shard
    from torchao import quantize_
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    from shardwise import fully_shard as sw_fully_shard

    runs = {}
    for name, fs in (("shardwise", sw_fully_shard), ("torch", pt_fully_shard)):
        torch.manual_seed(0)
        if kind == "nf4_qlora":
            model = nn.Sequential(_QLoRALinear(64, 128), nn.ReLU(), _QLoRALinear(128, 64))
        else:
            model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
            quantize_(model, int8_weight_only_quantized_training())
        for m in (model[0], model[2], model):
            fs(m)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
        runs[name] = _record_steps(model, opt, 64, reseed=True)  # int8 training rounds stochastically
    _assert_bit_equal(runs)


class _TPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d)
        self.w2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


@multi_rank(world_sizes=(4,))
def test_torchao_float8_with_tensor_parallel_matches_pytorch():
    """Float8 all-gathers of tensor-parallel weights (torchao's Float8Colwise /
    Float8RowwiseParallel on a (dp, tp) mesh, fully_shard over dp) with
    ``precompute_float8_dynamic_scale_for_fsdp`` after each step: bit for bit
    PyTorch's. The module sees its gathered weight as a DTensor on the TP mesh
    (it was a plain tensor, and the matmul refused to mix the two), and the
    pre-all-gather hook runs on the DTensor's own local tensor, where torchao
    keeps the precomputed scale (it ran on another object over the same
    memory, so the scale was computed again over dp only: different numbers)."""
    pytest.importorskip("torchao")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as pt_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from shardwise import fully_shard as sw_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for name, fs in (("shardwise", sw_fully_shard), ("torch", pt_fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(_TPBlock(32), _TPBlock(32), nn.Linear(32, 16))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn[:1] in "01")
        for block in model[:2]:
            parallelize_module(block, mesh["tp"], {"w1": Float8ColwiseParallel(), "w2": Float8RowwiseParallel()})
            fs(block, mesh=mesh["dp"])
        fs(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outs = []
        for step in range(3):
            g = torch.Generator().manual_seed(1000 * step + dist.get_rank() // 2)  # the same batch within a TP pair
            loss = model(torch.randn(8, 32, generator=g)).square().mean()
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(model)
            outs.append((loss.detach(), grads))
        runs[name] = (outs, {n: p.full_tensor() for n, p in model.named_parameters()})
    (outs, params), (pt_outs, pt_params) = runs["shardwise"], runs["torch"]
    for (loss, g), (pt_loss, pt_g) in zip(outs, pt_outs):
        assert torch.equal(loss, pt_loss), (loss, pt_loss)
        assert g.keys() == pt_g.keys()
        for n in g:
            assert torch.equal(g[n], pt_g[n]), n
    for n in params:
        assert torch.equal(params[n], pt_params[n]), n


class _StarArgsHook(BF16GatherTensor):
    def fsdp_pre_all_gather(self, *args, **kwargs):  # neither the 1- nor the 5-argument form
        return super().fsdp_pre_all_gather(*args, **kwargs)


_REF_TRANSFORM[_StarArgsHook] = _REF_TRANSFORM[BF16GatherTensor]


@multi_rank(world_sizes=(2,))
def test_extension_signature_error_as_pytorch():
    """A pre-hook taking ``(*args, **kwargs)`` (neither PyTorch's one- nor
    its five-argument form) is refused at the first all-gather with PyTorch's
    AssertionError and words, "Invalid fsdp_pre_all_gather"; shardwise called
    it with five arguments and the hook's own TypeError surfaced."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard as sw_fully_shard
    from shardwise.errors import ExtensionError

    for fs in (pt_fully_shard, sw_fully_shard):
        model, _ = _build(_StarArgsHook, (8, 8, 8))
        _shard(model, fs)
        with pytest.raises(AssertionError, match="Invalid fsdp_pre_all_gather") as info:
            model(_x(0, 8))
        if fs is sw_fully_shard:
            assert isinstance(info.value, ExtensionError)
