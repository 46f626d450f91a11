"""Which groups an implicit prefetch takes.

[Note: prefetch runs]
Over gloo a small collective costs mostly a fixed amount (see [Note:
held-back exchanges] in ``comm.py``), so for groups small enough the
implicit prefetch takes a run of them: the next group and those after it
(the ones before it, in backward) while their gathered bytes stay within
``_RUN_BYTES`` all told, issued inside ``comm.exchanges_together()`` so the
run travels as one exchange. The groups inside a run find their next group
already in flight and prefetch nothing; the last one starts the next run.
In backward, the queue of pending reductions then keeps as many as the run
is long, so the reduce-scatters of a run's groups, held back, travel with the
next run instead of each being sent alone when the queue waits for it.
Bounded by ``_RUN_BYTES``, this holds at most that many bytes more of
unsharded parameters than the one-ahead prefetch (gathered early, used in
order), and as many of reductions waiting. Only groups on the fast path with
the default all-gather over gloo take part (``run_bytes``). Over more than
two ranks a run's all-gathers travel as one all-gather and the reduce-scatters
held with them as one all-to-all. With an explicit prefetch
list, for groups that have one, and under the wrapper (FSDP1's
``limit_all_gathers``: at most two groups gathered) it is one group ahead
as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, Self, TypeVar

# Most gathered bytes a prefetch run holds: a group far below this (the
# 24-block benchmark's 200 KiB) pays mostly the fixed cost of its exchange;
# one near it (GPT 6x384's 7 MiB blocks) goes alone. 1 MiB (5 of those
# blocks) measured better than 4 MiB, where the first blocks of a run wait
# for all of it (docs/decisions.md, "small groups prefetch in runs").
_RUN_BYTES = 1 << 20


class RunMember(Protocol):
    def run_bytes(self) -> int | None:
        """The bytes of the all-gather this group would issue now, when that
        may travel in a run (None: not, or already issued)."""

    def may_follow(self, first: Self, backward: bool) -> bool:
        """Whether this group may join a run that ``first`` starts."""


G = TypeVar("G", bound=RunMember)


def prefetch_run(candidates: Iterable[G], backward: bool) -> list[G]:
    """The groups to prefetch from ``candidates`` (the next group first, in the
    order they will run): the first, then those after it while all of them
    may travel in one exchange."""
    it = iter(candidates)
    first = next(it, None)
    if first is None:
        return []
    run = [first]
    total = first.run_bytes()
    if total is None:
        return run
    for group in it:
        size = group.run_bytes()
        if size is None or total + size > _RUN_BYTES or group in run or not group.may_follow(first, backward):
            break
        run.append(group)
        total += size
    return run


__all__ = ["RunMember", "prefetch_run"]
