"""The watchdog's rule for who is stuck ([Note: watchdog] in shardwise.watchdog),
on made-up records: a rank that does not run, one blocked outside any
collective, ranks in different collectives; never a busy rank, one in its
first step, or when this rank is not waiting itself. And its arguments."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch.distributed as dist

from shardwise.errors import ConfigError, UsageError
from shardwise.watchdog import RankRecord, Watchdog, read_records

TIMEOUT = 10.0


def _rec(rank: int, **kw) -> RankRecord:
    base = dict(rank=rank, pid=1000 + rank, host="elsewhere", start="", beat=5, events=100, step=7,
                phase="forward", where="all_gather_copy_out (blocks.1)", waiting=True, busy=None, stalled=TIMEOUT,
                done=False)
    return RankRecord(**{**base, **kw})


def _judge(rank: int, first: list[RankRecord], second: list[RankRecord]):
    wd = Watchdog(TIMEOUT, store=dist.HashStore(), rank=rank, world_size=len(second))
    wd.rank, wd.world_size = rank, len(second)
    return wd._judge({r.rank: r for r in first}, {r.rank: r for r in second})


def test_a_rank_whose_beat_stops_does_not_run():
    first = [_rec(0), _rec(1, where=None, waiting=False)]
    second = [_rec(0, beat=9), _rec(1, where=None, waiting=False)]  # rank 1's beat stayed at 5
    verdict = _judge(0, first, second)
    assert verdict.stuck == (1,) and verdict.reason == "not running"
    # it does not matter what this rank does (e.g. a long save of its own)
    second[0] = replace(second[0], waiting=False, busy="checkpoint save")
    assert _judge(0, first, second).stuck == (1,)


def test_a_rank_that_never_reported_does_not_run():
    assert _judge(0, [_rec(0)], [_rec(0, beat=9)]) is None  # a world of one: nobody to wait on
    wd = Watchdog(TIMEOUT, store=dist.HashStore(), rank=0, world_size=2)
    wd.rank, wd.world_size = 0, 2
    assert wd._judge({0: _rec(0)}, {0: _rec(0, beat=9)}).stuck == (1,)


def test_a_running_rank_blocked_outside_any_collective_is_stuck():
    first = [_rec(0), _rec(1, where=None, waiting=False)]
    second = [_rec(0, beat=9), _rec(1, beat=9, where=None, waiting=False)]
    verdict = _judge(0, first, second)
    assert verdict.stuck == (1,) and verdict.reason == "blocked"


@pytest.mark.parametrize("busy", ["checkpoint save", "first step", "setting up (model, checkpoint)"])
def test_a_busy_rank_is_never_stuck(busy):
    first = [_rec(0), _rec(1, where=None, waiting=False, busy=busy)]
    second = [_rec(0, beat=9), _rec(1, beat=9, where=None, waiting=False, busy=busy)]
    assert _judge(0, first, second) is None


def test_no_verdict_unless_this_rank_waits_in_a_collective():
    # every rank slow in its own compute (a busy machine, a slow step everywhere): nobody is stuck
    first = [_rec(r, where=None, waiting=False) for r in range(2)]
    second = [_rec(r, beat=9, where=None, waiting=False) for r in range(2)]
    assert _judge(0, first, second) is None
    assert _judge(1, first, second) is None


def test_a_rank_still_progressing_is_not_stuck():
    first = [_rec(0), _rec(1, where=None, waiting=False)]
    second = [_rec(0, beat=9), _rec(1, beat=9, where=None, waiting=False, stalled=1.0)]
    assert _judge(0, first, second) is None


def test_a_rank_that_left_the_run_is_stuck():
    first = [_rec(0), _rec(1, done=True)]
    second = [_rec(0, beat=9), _rec(1, done=True)]
    assert _judge(0, first, second).stuck == (1,)


def test_ranks_in_different_collectives():
    first = [_rec(r) for r in range(3)]
    second = [_rec(0, beat=9), _rec(1, beat=9), _rec(2, beat=9, where="all_reduce (loss)")]
    verdict = _judge(0, first, second)
    assert verdict.stuck == (2,) and verdict.reason == "different collectives"
    # all in one collective and none completes: all of them
    second[2] = replace(second[2], where=second[0].where)
    assert _judge(0, first, second).stuck == (0, 1, 2)
    # all in the optimizer phase (its all-reduce, or a long step of its own) but no region: not yet
    assert _judge(0, first, [replace(r, where=None) for r in second]) is None
    # one of them still busy: not yet
    second[2] = replace(second[2], busy="checkpoint save")
    assert _judge(0, first, second) is None


def test_arguments_are_checked():
    with pytest.raises(ConfigError, match=r"timeout=1\): the timeout must be a number of seconds >= 2"):
        Watchdog(1)
    with pytest.raises(ConfigError, match="interval"):
        Watchdog(10, interval=5)
    assert Watchdog(300).interval == 5.0 and Watchdog(10).interval == 0.5 and Watchdog(2).interval == 0.25
    with pytest.raises(UsageError, match="init_process_group first, or pass store=, rank= and world_size="):
        Watchdog(10).start()


def test_records_are_published_and_read_back():
    store = dist.HashStore()
    wd = Watchdog(10, store=store, rank=0, world_size=1)
    with wd:
        wd.step(3)
        wd.phase("forward")
        with wd.collective("all_reduce (loss)"):
            rec = wd._record(0.0, done=False)
        assert rec.step == 3 and rec.phase == "forward" and rec.where == "all_reduce (loss)" and rec.waiting
        with wd.busy("checkpoint save"):
            assert wd._record(0.0, done=False).busy == "checkpoint save"
    recs = read_records(store, 1)
    assert recs[0].done and recs[0].step == 3 and json.loads(store.get("shardwise/watchdog/rank/0"))["rank"] == 0
