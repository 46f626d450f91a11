"""Profiler ranges for the engine's hooks, only while a profiler records.

``torch.profiler.record_function`` costs a few microseconds per range even
when nothing records; a step opens several per group, so with many small
groups that is a measurable share of the step. ``trace`` opens the range only
when the autograd profiler (which ``torch.profiler.profile`` drives) is on.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.profiler import record_function

_NOTHING = nullcontext()


def trace(name: str) -> AbstractContextManager[Any]:
    """``record_function(name)`` while profiling, else a no-op context."""
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return _NOTHING


__all__ = ["trace"]
