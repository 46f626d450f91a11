"""[Note: prefetch runs]: which groups an implicit prefetch takes."""

from shardwise._engine.prefetch import _RUN_BYTES, prefetch_run


class _Group:
    def __init__(self, name, size, follows=True):
        self.name, self.size, self.follows = name, size, follows

    def run_bytes(self):
        return self.size

    def may_follow(self, first, backward):
        return self.follows

    def __repr__(self):
        return self.name


def _names(run):
    return [g.name for g in run]


def test_small_groups_go_in_runs_up_to_the_bound():
    groups = [_Group(f"g{i}", 200_000) for i in range(8)]
    assert _names(prefetch_run(groups, backward=False)) == ["g0", "g1", "g2", "g3", "g4"]  # 1,000,000 <= 1 MiB
    assert _names(prefetch_run(groups[5:], backward=True)) == ["g5", "g6", "g7"]
    assert prefetch_run([], backward=False) == []


def test_large_groups_prefetch_one_ahead():
    groups = [_Group(f"g{i}", _RUN_BYTES) for i in range(3)] + [_Group("s", 1)]
    assert _names(prefetch_run(groups, backward=False)) == ["g0"]
    # a small group before a large one: the large one waits for its own turn
    assert _names(prefetch_run([_Group("s", 1), *groups], backward=False)) == ["s"]


def test_a_run_stops_at_a_group_that_may_not_travel_or_follow():
    issued = _Group("issued", None)  # already in flight, or not on the packed path
    assert _names(prefetch_run([issued, _Group("a", 1)], backward=False)) == ["issued"]
    assert _names(prefetch_run([_Group("a", 1), issued, _Group("b", 1)], backward=False)) == ["a"]
    explicit = _Group("explicit", 1, follows=False)  # e.g. its own prefetch list
    assert _names(prefetch_run([_Group("a", 1), explicit, _Group("b", 1)], backward=False)) == ["a"]
    a = _Group("a", 1)
    assert _names(prefetch_run([a, _Group("b", 1), a], backward=True)) == ["a", "b"]  # a group once
