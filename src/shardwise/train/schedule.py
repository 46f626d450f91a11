"""The learning-rate schedule: linear warm-up, then cosine decay.

A pure function of the step, so resuming from a checkpoint needs no
scheduler state: the step alone gives the rate.
"""

from __future__ import annotations

import math

__all__ = ["learning_rate"]


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, steps: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based).

    Steps ``1..warmup_steps`` rise linearly to ``lr`` (``lr * step /
    warmup_steps``); the remaining steps follow half a cosine from ``lr`` down
    to ``min_lr``, reached at ``step == steps``. Past ``steps``: ``min_lr``.

    Args:
        step: the optimizer step, from 1.
        lr: the peak rate.
        min_lr: the final rate.
        warmup_steps: steps of linear warm-up (0: none).
        steps: the schedule's length.
    """
    if step < 1:
        raise ValueError(f"learning_rate: step={step} must be >= 1 (steps count from 1)")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if step >= steps:
        return min_lr
    progress = (step - warmup_steps) / (steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
