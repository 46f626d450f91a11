"""Profiler ranges for the engine's hooks, only while a profiler records.

``torch.profiler.record_function`` costs a few microseconds per range even
when nothing records; a step opens several per group, so with many small
groups that is a measurable share of the step. ``trace`` opens the range only
when the autograd profiler (which ``torch.profiler.profile`` drives) is on.

Also the other wrappers the hooks' methods run under: the debug records of
each hook (``log_hook``) and ``outside_functorch``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar, cast

import torch
from torch.profiler import record_function

import shardwise.observe as observe

_NOTHING = nullcontext()
F = TypeVar("F", bound=Callable[..., Any])


def _fsdp_logger() -> logging.Logger:
    """Where PyTorch's fully_shard logs each hook at DEBUG: a child of the
    first logger that torch's log registry names for the ``fsdp`` alias (what
    ``TORCH_LOGS=fsdp`` turns on). Ours logs the same records there; naming a
    logger imports nothing. Without that registry entry: ``shardwise``'s own."""
    try:
        from torch._logging._internal import log_registry

        names = log_registry.log_alias_to_log_qnames.get("fsdp") or ["shardwise"]
    except (ImportError, AttributeError):
        names = ["shardwise"]
    return logging.getLogger(f"{names[0]}.fully_shard")


_LOG = _fsdp_logger()


def log_hook(label: str, module_fqn: str = "") -> None:
    """PyTorch's debug record of a hook: ``label``, then the module's name
    under the root in parentheses (none for the root)."""
    if _LOG.isEnabledFor(logging.DEBUG):
        _LOG.debug("%s", f"{label} ({module_fqn})" if module_fqn else label)


def trace(name: str) -> AbstractContextManager[Any]:
    """``record_function(name)`` while profiling; the same region told to
    ``shardwise.observe``'s observers (the planner's memory tracker) while
    one is registered; else a no-op context. ``name`` is
    ``"shardwise::<kind> (<group>)"``."""
    if observe.observing():
        kind, _, rest = name.removeprefix("shardwise::").partition(" (")
        inner = observe.region(kind, rest.removesuffix(")"))
        if torch._C._autograd._profiler_enabled():
            return _Both(record_function(name), inner)
        return inner
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return _NOTHING


class _Both:
    def __init__(self, first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


def outside_functorch(fn: F) -> F:
    """Run ``fn`` with functorch's transforms suspended when any is active
    (``torch.func.jvp`` / ``vmap`` through a sharded module, as PyTorch's
    FSDP does around the same three methods): gathering, copying out and
    freeing storage work on the real tensors, never on transform wrappers."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(F, wrapper)


__all__ = ["log_hook", "outside_functorch", "trace"]
