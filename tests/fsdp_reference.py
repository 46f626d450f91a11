"""Shared by the tests that run one scenario under shardwise and under
PyTorch's own FSDP2 and compare (tests/dist/test_like_pytorch_*.py): a small
model and the two ``fully_shard`` functions. Importable by the test ranks
because tests/conftest.py puts this folder on ``sys.path``."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


TORCH_VERSION: tuple[int, int] = tuple(  # type: ignore[assignment]
    int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()  # type: ignore[union-attr]
)
"""(major, minor) of the installed torch."""


def needs_torch(major: int, minor: int, what: str) -> pytest.MarkDecorator:
    """Skip a test that compares with PyTorch behaviour first found in
    ``major.minor`` (``what``) when an older torch is installed. On that
    version and later the test runs unchanged."""
    return pytest.mark.skipif(
        TORCH_VERSION < (major, minor),
        reason=f"compares with PyTorch >= {major}.{minor}'s {what}; this is torch {torch.__version__}",
    )


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin2(F.relu(self.lin1(x)))


class Net(nn.Module):
    def __init__(self, dim=8, n=2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _x(step=0, dim=8, n=4):
    """This rank's input for ``step``."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(n, dim, generator=g)


def _sw():
    from shardwise import fully_shard

    return fully_shard


def _pt():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _mp(**kw):
    """The same MixedPrecisionPolicy for (shardwise, PyTorch)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as PT

    from shardwise import MixedPrecisionPolicy as SW

    return SW(**kw), PT(**kw)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model):
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(a, b):
    """Same parameters with gradients, same gradient dtypes and values."""
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys(), (sorted(ga), sorted(gb))
    for k in ga:
        assert ga[k].dtype == gb[k].dtype, (k, ga[k].dtype, gb[k].dtype)
        torch.testing.assert_close(ga[k], gb[k], msg=k)


def _assert_params_equal(a, b):
    """Same full parameter values, name by name."""
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(_full(pa), _full(pb), msg=n)


def _steps_match(a, b, steps, same=None, zero_grad=True, opts=()):
    """Forward/backward steps of both models on the same inputs (``_x(it)`` for
    each ``it`` in ``steps``, or in ``range(steps)`` for an int), the outputs and
    gradients compared after each (and ``same(a) == same(b)`` when given); then
    each optimizer in ``opts`` steps, and the gradients are zeroed unless
    ``zero_grad`` is False (gradients accumulate)."""
    for it in range(steps) if isinstance(steps, int) else steps:
        _step_both(a, b, _x(it))
        _assert_grads_equal(a, b)
        if same is not None:
            assert same(a) == same(b), (same.__name__, it)
        for opt in opts:
            opt.step()
        if zero_grad:
            for m in (a, b):
                m.zero_grad()


def _param_types(model):
    return {n: "DTensor" if isinstance(p, DTensor) else type(p).__name__ for n, p in model.named_parameters()}


def _step_both(a, b, x, loss=lambda out: out.float().sum()):
    """Forward both on ``x`` (same output dtype and values), then backward."""
    oa, ob = a(x), b(x)
    assert oa.dtype == ob.dtype, (oa.dtype, ob.dtype)
    torch.testing.assert_close(oa, ob)
    loss(oa).backward()
    loss(ob).backward()


def _step_and_compare(a, b, x):
    """One step of both models on ``x``; then equal gradients and equal
    registered parameter types."""
    _step_both(a, b, x)
    _assert_grads_equal(a, b)
    assert _param_types(a) == _param_types(b)


def _train_compare(a, b, steps=2):
    """``steps`` steps on both: same outputs, gradients and registered parameter types."""
    for it in range(steps):
        _step_both(a, b, _x(it))
        _assert_grads_equal(a, b)
        assert _param_types(a) == _param_types(b)
        for m in (a, b):
            m.zero_grad()


def shard_blocks(model: nn.Module, lib: str = "shardwise", precision: str = "fp32") -> nn.Module:
    """Every block of ``model.blocks``, then the root, sharded by ``lib``'s
    ``fully_shard`` ("shardwise" or "torch"); ``precision="bf16"``: bf16
    parameters, fp32 gradient reduction."""
    if lib == "shardwise":
        from shardwise import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy()
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


class CollectiveLog(TorchDispatchMode):
    """Records every c10d collective issued inside it as (op, dtype of its
    first tensor, size of its process group) in ``log``."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, torch.dtype | None, int | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "c10d":
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lists = [a[0] for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)]
            groups = [g for g in map(_process_group, args) if g is not None]
            first = (tensors or lists or [None])[0]
            self.log.append((func.__name__.split(".")[0], first.dtype if first is not None else None,
                             groups[0].size() if groups else None))
        return func(*args, **(kwargs or {}))


def _process_group(obj: object) -> dist.ProcessGroup | None:
    """The ProcessGroup a c10d op received as ``obj``, or None (a tensor, a ReduceOp, ...)."""
    if type(obj).__name__ != "ScriptObject":
        return None
    try:
        return dist.ProcessGroup.unbox(obj)  # type: ignore[attr-defined,no-any-return]
    except RuntimeError:
        return None
