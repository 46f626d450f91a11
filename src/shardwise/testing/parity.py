"""Parity helpers: train a sharded model and an unsharded reference, compare.

The usual pattern, inside a function that runs on every rank::

    torch.manual_seed(0)
    ref = build_model()
    model = shard(copy.deepcopy(ref))
    for batch in batches:                 # the same batches on every rank
        model(batch).sum().backward()
        ref(batch).sum().backward()
        replicate_grads(ref)              # the reference is data parallel too
        assert_models_match(model, ref)
        ...

Every helper here that takes part in a collective must be called by all ranks
of the group, in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = [
    "assert_models_match",
    "assert_same_on_all_ranks",
    "full_tensor",
    "replicate_grads",
]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return the whole, unsharded value of ``t``.

    For a :class:`~torch.distributed.tensor.DTensor` this gathers the shards
    (a collective: call it on every rank); any other tensor is returned as is.

    Args:
        t: A tensor or DTensor.

    Returns:
        ``t.full_tensor()`` for a DTensor, else ``t`` itself.
    """
    if DTensor is not None and isinstance(t, DTensor):
        return t.full_tensor()
    return t


def replicate_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average the gradients of a plain, unsharded model across ranks.

    Every ``.grad`` that is not None is summed over ``group`` and divided by
    its size, in place, so a reference model that each rank trains on its own
    batch behaves like data-parallel training. Gradients are flattened per
    dtype and device, so the whole model costs one all-reduce per dtype.
    Every rank must hold the same parameters with the same gradients present.

    Args:
        model: The reference model; its parameters must be regular tensors.
        group: Process group to average over. (Default: ``None``, the default
            process group)

    Raises:
        TypeError: If a gradient is sparse or a DTensor.
    """
    world_size = dist.get_world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse or (DTensor is not None and isinstance(grad, DTensor)):
            raise TypeError(
                f"replicate_grads needs dense, regular gradients; '{name}' has a "
                f"{type(grad).__name__} with layout {grad.layout}"
            )
        buckets.setdefault((grad.dtype, grad.device), []).append(grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world_size)
        offset = 0
        for grad in grads:
            numel = grad.numel()
            grad.copy_(flat[offset : offset + numel].view(grad.shape))
            offset += numel


def _whole_values(model: nn.Module, grads: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each parameter's whole value (and gradient, if ``grads`` and it has one), by name."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            grad = param.grad
            out[name] = (full_tensor(param.detach()), full_tensor(grad) if grads and grad is not None else None)
    return out


def assert_models_match(
    model: nn.Module,
    ref_model: nn.Module,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    check_grads: bool = True,
    msg: str = "",
) -> None:
    """Assert that a (sharded) model's parameters and gradients match a reference.

    Parameters are paired by their ``named_parameters()`` names, which must be
    the same in both models. Sharded parameters and gradients are compared as
    full tensors (see :func:`full_tensor`); all of them are gathered before
    anything is compared, so every rank issues the same collectives even when
    the comparison fails. Every mismatch is reported, each naming its
    parameter.

    Args:
        model: The model under test; parameters may be DTensors.
        ref_model: The reference model (regular parameters, or sharded ones,
            compared whole).
        rtol: Relative tolerance for :func:`torch.testing.assert_close`; give
            it together with ``atol``. (Default: ``None``, dtype-based default)
        atol: Absolute tolerance; give it together with ``rtol``.
            (Default: ``None``, dtype-based default)
        check_grads: Also compare gradients; a None gradient only matches a
            None gradient. (Default: ``True``)
        msg: Text to put in front of the failure message. (Default: ``""``)

    Raises:
        AssertionError: Listing missing or unexpected parameter names and
            every parameter or gradient that differs.
        ValueError: If only one of ``rtol`` and ``atol`` is given.
    """
    if (rtol is None) != (atol is None):
        raise ValueError("rtol and atol must be given together (or both left out)")

    # Gather everything first: a failure must not leave peers in a collective.
    # The reference may be sharded too (PyTorch's FSDP as the reference).
    params = _whole_values(model, check_grads)
    ref_params = _whole_values(ref_model, check_grads)

    problems: list[str] = []
    missing = [name for name in ref_params if name not in params]
    unexpected = [name for name in params if name not in ref_params]
    if missing:
        problems.append(f"parameters missing from the model: {missing}")
    if unexpected:
        problems.append(f"parameters not in the reference model: {unexpected}")

    for name, (ref_value, ref_grad) in ref_params.items():
        if name not in params:
            continue
        value, grad = params[name]
        problem = _compare(value, ref_value, rtol, atol)
        if problem is not None:
            problems.append(f"parameter '{name}': {problem}")
        if not check_grads:
            continue
        if grad is None and ref_grad is None:
            continue
        if grad is None or ref_grad is None:
            which = "model" if grad is None else "reference model"
            problems.append(f"gradient of parameter '{name}': None in the {which} only")
            continue
        problem = _compare(grad, ref_grad, rtol, atol)
        if problem is not None:
            problems.append(f"gradient of parameter '{name}': {problem}")

    if problems:
        prefix = f"{msg}: " if msg else ""
        raise AssertionError(
            f"{prefix}model does not match the reference ({len(problems)} problem(s))\n\n"
            + "\n\n".join(problems)
        )


def _compare(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float | None, atol: float | None
) -> str | None:
    """Return assert_close's complaint about ``actual``, or None if close."""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        return str(exc)
    return None


def assert_same_on_all_ranks(
    value: float | torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    msg: str = "",
) -> None:
    """Assert that ``value`` is exactly the same on every rank.

    The value is gathered with ``all_gather_object`` (so values of different
    shapes or types compare instead of hanging) and every rank's value is
    compared with rank 0's, NaNs being equal to NaNs. Every rank raises the
    same error.

    Args:
        value: A Python number or a tensor (a DTensor is compared as its full
            tensor, which is a collective).
        group: Process group to compare across. (Default: ``None``, the default
            process group)
        msg: Text to put in front of the failure message. (Default: ``""``)

    Raises:
        AssertionError: Naming each rank whose value differs from rank 0's.
        TypeError: If ``value`` is neither a number nor a tensor.
    """
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            local: object = full_tensor(value).detach().cpu()
    elif isinstance(value, (int, float)):
        local = value
    else:
        raise TypeError(f"expected a number or a tensor, got {type(value).__name__}")
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)

    problems: list[str] = []
    for rank, other in enumerate(gathered[1:], start=1):
        try:
            torch.testing.assert_close(other, gathered[0], rtol=0, atol=0, equal_nan=True)
        except AssertionError as exc:
            problems.append(f"rank {rank} differs from rank 0: {exc}")
    if problems:
        prefix = f"{msg}: " if msg else ""
        detail = ""
        if not isinstance(value, torch.Tensor):
            detail = f"\nvalues by rank: {gathered}"
        raise AssertionError(
            f"{prefix}value differs across ranks{detail}\n\n" + "\n\n".join(problems)
        )
