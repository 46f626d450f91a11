"""Train a sharded model next to an unsharded reference, step by step.

The reference is a deep copy of the model taken before sharding, trained on
every rank with the same per-rank batches and its gradients averaged over the
ranks (what data parallel does), so after every step the sharded model's
loss, full parameters and full gradients must match it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .parity import assert_models_match, replicate_grads

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Tolerance:
    """Tolerances for losses and for parameters/gradients (``None``: dtype defaults)."""

    loss_rtol: float | None = None
    loss_atol: float | None = None
    rtol: float | None = None
    atol: float | None = None


EXACT = Tolerance()


def parity_train(
    make_model: Callable[[], nn.Module],
    shard: Callable[[nn.Module], object],
    make_batch: Callable[[int, int], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int = 3,
    lr: float = 1e-2,
    tol: Tolerance = EXACT,
    check_grads: bool = True,
    seed: int = 0,
    clip: float | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    prepare_reference: Callable[[nn.Module], object] | None = None,
    reference: Callable[[nn.Module], nn.Module] | None = None,
) -> list[float]:
    """Train ``shard(model)`` and an unsharded deep copy side by side; assert
    parity of losses, parameters and gradients after every step.

    Args:
        make_model: builds the model (called once, under ``torch.manual_seed(seed)``).
        shard: applies sharding to the model in place (e.g. ``fully_shard`` calls);
            if it returns a module (e.g. a ``FullyShardedDataParallel`` wrapper),
            that module is trained.
        make_batch: ``(step, rank) -> (inputs, targets)``.
        loss_fn: ``(output, targets) -> scalar loss``.
        steps: training steps. (Default: ``3``)
        lr: AdamW learning rate. (Default: ``1e-2``)
        tol: tolerances. (Default: exact up to float32 rounding)
        check_grads: compare gradients too. (Default: ``True``)
        seed: seed for building the model. (Default: ``0``)
        clip: if set, clip gradients to this norm on both models. (Default: ``None``)
        param_dtype: the sharded model's mixed-precision compute dtype; the
            reference then computes in a copy cast to it, averages gradients in
            ``reduce_dtype`` and steps full-precision master weights.
            (Default: ``None``: full precision)
        reduce_dtype: the dtype gradients are averaged in. (Default: ``None``:
            ``param_dtype``)
        prepare_reference: applied in place to the module the reference
            computes with (its low-precision copy under ``param_dtype``), e.g.
            to compile it as ``shard`` compiles the sharded model, so both
            run the same kernels. (Default: ``None``)
        reference: makes the reference data parallel itself instead of
            averaging its gradients here: given the reference model, returns
            the module to train (e.g. ``DistributedDataParallel(m)``, or
            ``m`` after PyTorch's ``fully_shard``, applying the same mixed
            precision as ``shard``). (Default: ``None``: an unsharded copy
            on every rank, gradients averaged by ``replicate_grads``)

    Returns:
        The sharded model's loss at every step.
    """
    torch.manual_seed(seed)
    ref = make_model()
    model = copy.deepcopy(ref)
    sharded = shard(model)
    if isinstance(sharded, nn.Module):
        model = sharded  # a wrapper (FullyShardedDataParallel) replaces the model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt: torch.optim.Optimizer
    if reference is not None:
        # The reference averages its own gradients (and casts, for PyTorch's FSDP).
        ref_compute = reference(ref)
        param_dtype = None
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    else:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
        # Mixed precision: compute in a low-precision copy, keep fp32 master weights.
        ref_compute = ref if param_dtype is None else copy.deepcopy(ref).to(param_dtype)
    if prepare_reference is not None:
        prepare_reference(ref_compute)
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        x, y = make_batch(step, rank)
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        ref_loss = loss_fn(ref_compute(x), y)
        ref_loss.backward()  # type: ignore[no-untyped-call]
        if reference is not None:
            pass  # already averaged by the reference's own data parallelism
        elif ref_compute is not ref:
            _reduce_into_master(ref_compute, ref, reduce_dtype or param_dtype)  # type: ignore[arg-type]
        else:
            replicate_grads(ref)
        torch.testing.assert_close(
            loss.detach().float(), ref_loss.detach().float(), rtol=tol.loss_rtol, atol=tol.loss_atol,
            msg=lambda m: f"step {step} rank {rank}: loss differs from the reference: {m}",
        )
        if check_grads:
            assert_models_match(model, ref, rtol=tol.rtol, atol=tol.atol, msg=f"step {step} grads")
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm_full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            torch.testing.assert_close(norm_full, ref_norm, rtol=tol.rtol, atol=tol.atol)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if ref_compute is not ref and reference is None:
            with torch.no_grad():
                for p_lp, p in zip(ref_compute.parameters(), ref.parameters()):
                    p_lp.copy_(p)
        assert_models_match(model, ref, rtol=tol.rtol, atol=tol.atol, check_grads=False, msg=f"step {step} params")
        losses.append(loss.item())
    return losses


def _reduce_into_master(compute: nn.Module, master: nn.Module, reduce_dtype: torch.dtype) -> None:
    """Average the low-precision gradients over ranks in ``reduce_dtype`` and
    install them, in the master's dtype, as the master weights' gradients."""
    world = dist.get_world_size()
    for p_lp, p in zip(compute.parameters(), master.parameters()):
        if p_lp.grad is None:
            p.grad = None
            continue
        grad = p_lp.grad.to(reduce_dtype)
        dist.all_reduce(grad)
        p.grad = (grad / world).to(p.dtype)
        p_lp.grad = None
