"""The wrapper's prefetch options change the issue order of collectives as
SPEC §2 describes; strategies change which collectives run and over which
groups. Orders are recorded by wrapping the engine's collective starters."""

from __future__ import annotations

import contextlib

import pytest
import torch

from shardwise.testing import multi_rank

N_LAYERS = 3


@contextlib.contextmanager
def _record():
    """Log ("AG"|"RS", group name, process-group size) for every collective the
    engine issues; markers are appended to the same log by hooks."""
    from shardwise._engine import collectives as coll

    log: list[tuple[str, str, int]] = []
    orig_ag, orig_rs = coll.start_all_gather, coll.start_reduce_scatter

    def ag(comm, flat_source, flat, group, dtype, device, where, *rest):
        log.append(("AG", where, group.size()))
        return orig_ag(comm, flat_source, flat, group, dtype, device, where, *rest)

    def rs(comm, grads, flat, group, dtype, device, predivide, where, *rest):
        log.append(("RS", where, group.size()))
        return orig_rs(comm, grads, flat, group, dtype, device, predivide, where, *rest)

    coll.start_all_gather, coll.start_reduce_scatter = ag, rs
    try:
        yield log
    finally:
        coll.start_all_gather, coll.start_reduce_scatter = orig_ag, orig_rs


def _model(strategy="FULL_SHARD", backward="BACKWARD_PRE", forward=False, **kwargs):
    from shardwise import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from shardwise.models import GPT, Block, GPTConfig
    from shardwise.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=N_LAYERS, n_heads=2)
    model = FullyShardedDataParallel(
        GPT(cfg),
        sharding_strategy=getattr(ShardingStrategy, strategy),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        backward_prefetch=None if backward is None else getattr(BackwardPrefetch, backward),
        forward_prefetch=forward,
        **kwargs,
    )
    return model, cfg


def _name(i):
    return f"blocks.{i}._fsdp_wrapped_module"


def _add_markers(model, log):
    """("FWD", block) when a block's forward computation starts (after its
    pre-forward hook), ("BWD", block) when its backward computation starts."""
    for i, block in enumerate(model.blocks):
        inner = block.module

        def pre(mod, args, i=i):
            log.append(("FWD", _name(i), 0))

        def post(mod, args, out, i=i):
            if out.requires_grad:
                out.register_hook(lambda g, i=i: log.append(("BWD", _name(i), 0)))

        # Registered after fully_shard's hooks, so they run after them.
        inner.register_forward_pre_hook(pre)
        inner.register_forward_hook(post)


def _step(model, cfg, log=None, seed=0):
    import torch.distributed as dist

    from shardwise.models import GPT, synthetic_batch

    x, y = synthetic_batch(cfg, 2, seed=seed, rank=dist.get_rank())
    out = model(x)
    if log is not None:
        log.append(("END_FWD", "", 0))
    GPT.loss(out, y).backward()


def _recorded_step(model, cfg):
    _step(model, cfg)  # the first iteration records the forward order
    with _record() as log:
        _add_markers(model, log)
        _step(model, cfg, log)
    return log


def _pos(log, kind, name, after=0):
    for i in range(after, len(log)):
        if log[i][0] == kind and log[i][1] == name:
            return i
    raise AssertionError(f"{kind} {name} not in {log}")


@pytest.mark.parametrize("forward", [False, True])
@multi_rank(world_sizes=(2,))
def test_forward_prefetch_issues_next_gather_before_current_compute(forward):
    model, cfg = _model(forward=forward)
    log = _recorded_step(model, cfg)
    for i in range(N_LAYERS - 1):
        nxt = _pos(log, "AG", _name(i + 1))
        compute = _pos(log, "FWD", _name(i))
        assert (nxt < compute) == forward, log
    assert [e[:2] for e in log if e[0] == "AG"][: N_LAYERS + 1] == [("AG", "GPT (root)")] + [
        ("AG", _name(i)) for i in range(N_LAYERS)
    ]


@pytest.mark.parametrize("backward", ["BACKWARD_PRE", "BACKWARD_POST", None])
@multi_rank(world_sizes=(2,))
def test_backward_prefetch_order(backward):
    """BACKWARD_PRE gathers block i-1 before block i's gradient computation;
    BACKWARD_POST and None after it. No gather after the last reduce-scatter,
    and per step exactly one gather per group in forward and per block in backward."""
    model, cfg = _model(backward=backward)
    log = _recorded_step(model, cfg)
    end = _pos(log, "END_FWD", "")
    for i in range(N_LAYERS - 1, 0, -1):
        bwd = _pos(log, "BWD", _name(i), end)
        prev_gather = _pos(log, "AG", _name(i - 1), end)
        assert (prev_gather < bwd) == (backward == "BACKWARD_PRE"), (i, log)
        # and never before block i's own gather
        assert prev_gather > _pos(log, "AG", _name(i), end), log
    last_rs = max(i for i, e in enumerate(log) if e[0] == "RS")
    assert not [e for e in log[last_rs:] if e[0] == "AG"], log
    ags = [e for e in log if e[0] == "AG"]
    rss = [e for e in log if e[0] == "RS"]
    assert len(ags) == 1 + 2 * N_LAYERS and len(rss) == 1 + N_LAYERS, log


def _backward_post_log():
    model, cfg = _model(backward="BACKWARD_POST")
    return _recorded_step(model, cfg)


def test_backward_post_gathers_next_before_current_reduce_scatter():
    # Asserted here, not on the ranks, so that the expected failure leaves the workers alone.
    from shardwise.testing import run_on_ranks

    for log in run_on_ranks(_backward_post_log, 2):
        end = _pos(log, "END_FWD", "")
        for i in range(N_LAYERS - 1, 0, -1):
            assert _pos(log, "AG", _name(i - 1), end) < _pos(log, "RS", _name(i), end), log


@pytest.mark.parametrize("backward", ["BACKWARD_PRE", "BACKWARD_POST", None])
@pytest.mark.parametrize("forward", [False, True])
@multi_rank(world_sizes=(2,))
def test_limit_all_gathers_bounds_unsharded_groups(forward, backward):
    """limit_all_gathers=True: besides the root, at most two groups (the
    current and one prefetched) hold gathered parameters at any time."""
    from shardwise._engine.module_state import states_under

    model, cfg = _model(backward=backward, forward=forward, limit_all_gathers=True)
    groups = [s.group for s in states_under(model) if s.group is not None]
    root = groups[0]
    peak = [0]

    def sample(*_):
        busy = sum(1 for g in groups if g is not root and (g.is_unsharded or g._in_flight is not None))
        peak[0] = max(peak[0], busy)

    def on_output(module, args, out):
        out.register_hook(lambda grad: sample())

    for block in model.blocks:
        block.module.register_forward_pre_hook(lambda m, a: sample())
        block.module.register_forward_hook(on_output)
    for seed in range(2):
        _step(model, cfg, seed=seed)
    assert 1 <= peak[0] <= 2, peak
    if forward or backward == "BACKWARD_PRE":
        assert peak[0] == 2  # prefetching really holds the next group too


@multi_rank(world_sizes=(2,))
def test_limit_all_gathers_false_warns():
    with pytest.warns(UserWarning, match="limit_all_gathers=False has no effect"):
        _model(limit_all_gathers=False)


@multi_rank(world_sizes=(2,))
def test_shard_grad_op_keeps_params_through_backward_and_no_sync():
    model, cfg = _model("SHARD_GRAD_OP")
    _step(model, cfg)
    with _record() as log:
        _step(model, cfg, log)
    end = _pos(log, "END_FWD", "")
    assert [e for e in log[end:] if e[0] == "AG"] == [], log  # no gathers in backward
    assert len([e for e in log[:end] if e[0] == "AG"]) == 1 + N_LAYERS
    with _record() as log:
        with model.no_sync():
            _step(model, cfg, seed=1)
            _step(model, cfg, seed=2)  # parameters are still gathered: no all-gather at all
        _step(model, cfg, seed=3)  # still gathered; this backward reduces
    assert [e for e in log if e[0] == "AG"][: 1 + N_LAYERS] == [e for e in log if e[0] == "AG"], log
    rs = [e for e in log if e[0] == "RS"]
    assert len(rs) == 1 + N_LAYERS, log
    with _record() as log:
        _step(model, cfg, seed=4)  # resharded after the synchronised backward: gathers again
    assert len([e for e in log if e[0] == "AG"]) == 1 + N_LAYERS


@multi_rank(world_sizes=(2,))
def test_full_shard_no_sync_gathers_but_never_reduces():
    model, cfg = _model("FULL_SHARD")
    _step(model, cfg)
    with _record() as log, model.no_sync():
        _step(model, cfg, seed=1)
    assert not [e for e in log if e[0] == "RS"]
    assert len([e for e in log if e[0] == "AG"]) == 1 + 2 * N_LAYERS
    with _record() as log:
        _step(model, cfg, seed=2)
    assert len([e for e in log if e[0] == "RS"]) == 1 + N_LAYERS


@multi_rank(world_sizes=(4,))
def test_groups_per_strategy():
    """Gathers and reduce-scatters run over 4 ranks (FULL_SHARD), over the
    2 ranks of a node (HYBRID_SHARD), over 1 rank (NO_SHARD: gradients are
    all-reduced instead, checked by the parity tests)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for strategy, kwargs, size, group_size in [
        ("FULL_SHARD", {}, 4, 4),
        ("HYBRID_SHARD", {"device_mesh": mesh}, 2, 2),
        ("_HYBRID_SHARD_ZERO2", {"device_mesh": mesh}, 2, 2),
        ("NO_SHARD", {}, 1, 4),  # like PyTorch: process_group is every replica
    ]:
        model, cfg = _model(strategy, **kwargs)
        assert model.world_size == group_size and model.process_group.size() == group_size
        _step(model, cfg)
        with _record() as log:
            _step(model, cfg)
        assert {e[2] for e in log if e[0] in ("AG", "RS")} == {size}, (strategy, log)
        gathers_in_backward = [e for e in log[_pos(log, "AG", "GPT (root)") + N_LAYERS + 1 :] if e[0] == "AG"]
        assert bool(gathers_in_backward) == (strategy in ("FULL_SHARD", "HYBRID_SHARD")), (strategy, log)
