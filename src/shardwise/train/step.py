"""One optimizer step of ``shardwise train``, shared by the training loop and
the planner (which runs exactly this under fake tensors); see
[Note: one training step] in ``shardwise.train.loop``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from shardwise.models import GPT
from shardwise.train.config import TrainConfig

__all__ = ["make_optimizer", "training_step"]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters: weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
    )


def training_step(
    model: nn.Module,
    logits: Callable[[Tensor], Tensor],
    optim: torch.optim.Optimizer,
    next_batch: Callable[[], tuple[Tensor, Tensor]],
    *,
    grad_accum: int,
    grad_clip: float,
    lr: float,
    on_phase: Callable[[str], None] | None = None,
) -> Tensor:
    """Forward and backward over ``grad_accum`` micro-batches (gradient sync
    only on the last), clip, set ``lr`` and step; returns the summed loss
    (already divided by ``grad_accum``, detached).

    Args:
        model: the sharded model.
        logits: token ids ``[B, T]`` -> logits ``[B, T, V]``.
        optim: the optimizer over ``model``'s parameters.
        next_batch: the next micro-batch ``(inputs, targets)`` on the compute device.
        grad_accum: micro-steps per optimizer step.
        grad_clip: global gradient-norm bound; ``0``: no clipping.
        lr: the learning rate for this step.
        on_phase: called with ``"forward"``, ``"backward"`` and ``"optimizer"``
            as the step enters each (the planner's memory tracker listens).
            (Default: ``None``)
    """
    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name)

    total: Tensor | None = None
    for micro in range(grad_accum):
        if grad_accum > 1:
            model.set_requires_gradient_sync(micro == grad_accum - 1)  # type: ignore[operator]
        x, y = next_batch()
        phase("forward")
        loss = GPT.loss(logits(x), y) / grad_accum
        phase("backward")
        loss.backward()  # type: ignore[no-untyped-call]
        total = loss.detach() if total is None else total + loss.detach()
    phase("optimizer")
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for group in optim.param_groups:
        group["lr"] = lr
    optim.step()
    if total is None:  # pragma: no cover - grad_accum >= 1 is validated
        raise AssertionError("training_step: grad_accum must be >= 1")
    return total
