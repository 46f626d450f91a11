"""Collectives counted per step, issue order (prefetch), and the memory bound."""

from __future__ import annotations

import contextlib

import pytest
import torch

from shardwise.testing import multi_rank

N_LAYERS = 3


def _model(reshard=None, mp=None, n_layers=N_LAYERS):
    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=n_layers, n_heads=2)
    model = GPT(cfg)
    kw = {"mp_policy": mp or MixedPrecisionPolicy()}
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True if reshard is None else reshard, **kw)
    fully_shard(model, **kw)
    return model, cfg


@contextlib.contextmanager
def _record():
    """Record every collective the engine issues: (kind, group name, dtype)."""
    from shardwise._engine import collectives as coll

    log = []
    orig_ag, orig_rs = coll.start_all_gather, coll.start_reduce_scatter

    def ag(comm, flat_source, flat, group, dtype, device, where, *rest):
        log.append(("AG", where, dtype))
        return orig_ag(comm, flat_source, flat, group, dtype, device, where, *rest)

    def rs(comm, grads, flat, group, dtype, device, predivide, where, *rest):
        log.append(("RS", where, dtype))
        return orig_rs(comm, grads, flat, group, dtype, device, predivide, where, *rest)

    coll.start_all_gather, coll.start_reduce_scatter = ag, rs
    try:
        yield log
    finally:
        coll.start_all_gather, coll.start_reduce_scatter = orig_ag, orig_rs


def _step(model, cfg, seed=0):
    from shardwise.models import GPT, synthetic_batch

    x, y = synthetic_batch(cfg, 2, seed=seed, rank=torch.distributed.get_rank())
    GPT.loss(model(x), y).backward()


@pytest.mark.parametrize("reshard", [True, False])
@multi_rank(world_sizes=(2,))
def test_collectives_per_step(reshard):
    model, cfg = _model(reshard)
    _step(model, cfg)  # first iteration records the order
    with _record() as log:
        _step(model, cfg)
    ags = [e for e in log if e[0] == "AG"]
    rss = [e for e in log if e[0] == "RS"]
    # root: 1 gather (kept for backward); each block: 1 in forward, +1 in backward if resharded
    assert len(ags) == 1 + N_LAYERS * (2 if reshard else 1), log
    assert len(rss) == 1 + N_LAYERS, log
    assert sorted(e[1] for e in rss) == sorted(["GPT (root)"] + [f"blocks.{i}" for i in range(N_LAYERS)])


@multi_rank(world_sizes=(2,))
def test_no_collectives_while_sync_off_then_one_reduce():
    model, cfg = _model()
    model.set_requires_gradient_sync(False)
    with _record() as log:
        _step(model, cfg, seed=0)
        _step(model, cfg, seed=1)
    assert not [e for e in log if e[0] == "RS"], log
    model.set_requires_gradient_sync(True)
    with _record() as log:
        _step(model, cfg, seed=2)
    assert len([e for e in log if e[0] == "RS"]) == 1 + N_LAYERS


@multi_rank(world_sizes=(2,))
def test_bf16_all_gather_and_fp32_reduce():
    from shardwise import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, cfg = _model(mp=mp)
    with _record() as log:
        _step(model, cfg)
    assert {e[2] for e in log if e[0] == "AG"} == {torch.bfloat16}
    assert {e[2] for e in log if e[0] == "RS"} == {torch.float32}
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


@multi_rank(world_sizes=(2,))
def test_prefetch_issue_order():
    model, cfg = _model()
    _step(model, cfg)
    events = []
    # a user hook after ours: at block i's compute, block i+1 must already be in flight
    for i, block in enumerate(model.blocks):
        def hook(mod, args, i=i):
            nxt = model.blocks[i + 1]._get_fsdp_state().group if i + 1 < N_LAYERS else None
            events.append((i, nxt is None or nxt._in_flight is not None or nxt.is_unsharded))
        block.register_forward_pre_hook(hook)
    with _record() as log:
        _step(model, cfg)
    assert events and all(ok for _, ok in events), events
    # backward: block i-1's all-gather is issued before block i's reduce-scatter
    names = [(k, w) for k, w, _ in log]
    fwd_end = max(j for j, (k, w) in enumerate(names) if (k, w) == ("AG", f"blocks.{N_LAYERS - 1}"))
    bwd = names[fwd_end:]
    for i in range(1, N_LAYERS):
        ag_prev = [j for j, e in enumerate(bwd) if e == ("AG", f"blocks.{i - 1}")]
        rs_cur = bwd.index(("RS", f"blocks.{i}"))
        assert ag_prev and ag_prev[0] < rs_cur, bwd


@pytest.mark.parametrize("prefetch", ["one_ahead", "explicit", "runs"])
@multi_rank(world_sizes=(2,))
def test_at_most_current_and_prefetched_unsharded(prefetch):
    """Besides the root, never more than two groups hold unsharded parameters,
    or, where small groups' prefetches travel together ([Note: prefetch
    runs]), never more gathered bytes than the current group's and a run's."""
    import shardwise._engine.prefetch as pg
    from shardwise._engine.param_group import ParamGroup

    run_bytes = pg._RUN_BYTES
    if prefetch == "one_ahead":
        pg._RUN_BYTES = 0
    model, cfg = _model(n_layers=4)
    blocks = list(model.blocks)
    if prefetch == "explicit":
        for i, b in enumerate(blocks):
            b.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            b.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    groups = [b._get_fsdp_state().group for b in blocks]
    peak = {"n": 0, "samples": 0, "bytes": 0}
    orig_unshard, orig_wait = ParamGroup.unshard, ParamGroup.wait_for_unshard
    sizes = {id(g): g.plan.flat.total * 2 * 4 for g in groups}  # fp32, two ranks

    def sample():
        live = [g for g in groups if g.is_unsharded or g._in_flight is not None]
        peak["n"] = max(peak["n"], len(live))
        peak["bytes"] = max(peak["bytes"], sum(sizes[id(g)] for g in live))
        peak["samples"] += 1

    def unshard(self, async_op=False):
        orig_unshard(self, async_op)
        sample()

    def wait(self):
        orig_wait(self)
        sample()

    ParamGroup.unshard, ParamGroup.wait_for_unshard = unshard, wait
    try:
        for seed in range(3):
            _step(model, cfg, seed)
    finally:
        ParamGroup.unshard, ParamGroup.wait_for_unshard = orig_unshard, orig_wait
        pg._RUN_BYTES = run_bytes
    assert peak["samples"] > 10, peak
    if prefetch == "runs":
        # 4 blocks far below the bound: all gathered at once, one exchange
        assert peak["n"] == 4 and peak["bytes"] <= max(sizes.values()) + run_bytes, peak
    else:
        assert peak["n"] == 2, peak
    assert all(not g.is_unsharded for g in groups)


@multi_rank(world_sizes=(4,))
def test_sharded_bytes_are_chunk_rows():
    from torch.distributed.tensor import DTensor

    from shardwise import fully_shard

    torch.manual_seed(0)
    # dim-0 sizes 1, 3, 5, 8: fewer rows than ranks, uneven, even
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 1), torch.nn.Linear(1, 3), torch.nn.Linear(3, 5), torch.nn.Linear(5, 8)
    )
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model)
    rank = torch.distributed.get_rank()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements[0].is_shard(0)
        chunks = torch.chunk(ref[name], 4, dim=0)
        expected = chunks[rank] if rank < len(chunks) else ref[name][:0]
        assert p.to_local().shape == expected.shape, (name, p.to_local().shape, expected.shape)
        assert torch.equal(p.to_local(), expected), name
        assert p.to_local().untyped_storage().nbytes() >= p.to_local().nbytes
        assert torch.equal(p.full_tensor(), ref[name])


@multi_rank(world_sizes=(2,))
def test_backward_prefetch_in_post_backward():
    """FSDP1's BACKWARD_POST order: block i's gradients are computed and its
    parameters freed before block i-1's all-gather, which is issued before
    block i's reduce-scatter (so that reduce-scatter overlaps the next compute)."""
    model, cfg = _model()
    for state in [b._get_fsdp_state() for b in model.blocks] + [model._get_fsdp_state()]:
        state.group.settings.prefetch_in_post_backward = True
    _step(model, cfg)
    with _record() as log:
        _step(model, cfg)
    names = [(k, w) for k, w, _ in log]
    fwd_ag = {w: j for j, (k, w) in enumerate(names) if k == "AG" and j < len(names) // 2}
    for i in range(1, N_LAYERS):
        rs_cur = names.index(("RS", f"blocks.{i}"))
        ag_prev = max(j for j, e in enumerate(names) if e == ("AG", f"blocks.{i - 1}"))
        assert ag_prev > fwd_ag.get(f"blocks.{i - 1}", -1) and ag_prev < rs_cur, names
    # each block gathered exactly twice (forward, backward): no gather after its backward
    for i in range(N_LAYERS):
        assert names.count(("AG", f"blocks.{i}")) == 2, names


@multi_rank(world_sizes=(2,))
def test_keep_low_precision_grads():
    """Kept low-precision gradients are the reduced bf16 gradients themselves:
    the same values as the run that casts them up to fp32, local tensors and
    all (not fp32 zeros under a bf16 DTensor)."""
    from shardwise import MixedPrecisionPolicy

    grads = []
    for keep in (False, True):
        model, cfg = _model(mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        for b in model.blocks:
            b._get_fsdp_state().group.settings.keep_low_precision_grads = keep
        _step(model, cfg)
        if keep:
            for b in model.blocks:
                for p in b.parameters():
                    assert p.dtype == torch.float32 and p.grad.dtype == p.grad.to_local().dtype == torch.bfloat16
            assert model.tok_emb.weight.grad.dtype == torch.float32
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    assert any(g.abs().sum() > 0 for g in grads[1].values())
    for n, g in grads[0].items():
        assert torch.equal(grads[1][n].float(), g), n


@multi_rank(world_sizes=(2,))
def test_original_full_parameters_are_released():
    import gc
    import weakref

    from shardwise import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    refs = [weakref.ref(p) for p in model.parameters()]
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(2, 64)).sum().backward()
    gc.collect()
    assert all(r() is None for r in refs), "fully_shard kept an unsharded copy alive"
    assert all(p.is_leaf and p._local_tensor.grad_fn is None for p in model.parameters())
    held = sum(p.to_local().numel() for p in model.parameters())
    assert held == sum(p.numel() for p in model.parameters()) // 2


@pytest.mark.parametrize("front", ["fully_shard", "wrapper"])
@multi_rank(world_sizes=(2,))
def test_a_dropped_model_is_freed(front):
    """Dropping a sharded, trained model frees it: its parameters, states,
    groups and optimizer state (nothing of the engine's keeps it alive)."""
    import gc
    import weakref

    from shardwise import FullyShardedDataParallel, fully_shard
    from shardwise._engine.module_state import state_of

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    if front == "fully_shard":
        fully_shard(model[0])
        fully_shard(model)
    else:
        model[0] = FullyShardedDataParallel(model[0])
        model = FullyShardedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(2, 64)).sum().backward()
        optim.step()
        optim.zero_grad()
    states = [state_of(m) for m in model.modules() if state_of(m) is not None]
    assert len(states) == 2
    refs = [weakref.ref(o) for o in (model, *model.parameters(), *states, *(s.group for s in states))]
    del model, optim, states
    gc.collect()
    assert [r() for r in refs if r() is not None] == []


@multi_rank(world_sizes=(2,))
def test_unsharded_params_share_one_buffer_freed_at_once():
    """A group's unsharded parameters live in one storage (allocated and freed
    once per unshard / reshard), each a tensor of its own: writing one leaves
    the others' autograd versions alone. Training is unchanged (parity)."""
    from shardwise.models import GPT, GPTConfig, synthetic_batch
    from shardwise.testing import assert_models_match, replicate_grads

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=2, n_heads=2))
    model, cfg = _model(reshard=False, n_layers=2)
    block = model.blocks[0]
    _step(model, cfg)  # reshard_after_forward=False: unsharded until after backward
    block.unshard()
    params = [p for p in block.parameters()]
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1, storages
    size = params[0].untyped_storage().size()
    assert size >= sum(p.numel() * p.element_size() for p in params)
    versions = [p._version for p in params]
    with torch.no_grad():
        params[0].mul_(1.0)
    assert [p._version for p in params[1:]] == versions[1:]
    block.reshard()
    state = block._get_fsdp_state()
    assert all(sp.unsharded_param.untyped_storage().size() == 0 for sp in state.group.params)
    # and the numbers are those of an unsharded model given the same batch
    model.zero_grad()
    _step(model, cfg, seed=1)
    x, y = synthetic_batch(cfg, 2, seed=1, rank=torch.distributed.get_rank())
    GPT.loss(ref(x), y).backward()
    replicate_grads(ref)
    assert_models_match(model, ref)


@multi_rank(world_sizes=(2,))
def test_comm_buffers_are_reused_within_a_step_and_freed_after_backward():
    """Within a step, groups of one size share their buffers through the
    pool (fewer buffers made than collectives issued); when backward ends
    the pool is empty, so no buffer sits idle through the optimizer step;
    every step then makes the same few again."""
    from shardwise._engine import collectives as coll

    model, cfg = _model()
    fresh = []
    orig_take = coll.BufferPool.take

    def take(self, numel, dtype, device):
        free = self._free.get((numel, dtype, device))
        if not free:
            fresh.append(numel)
        return orig_take(self, numel, dtype, device)

    taken = []
    orig_give = coll.BufferPool.give

    def give(self, *buffers):
        taken.extend(buffers)
        return orig_give(self, *buffers)

    coll.BufferPool.take = take
    coll.BufferPool.give = give
    try:
        counts, returned = [], []
        for seed in range(3):
            before, given = len(fresh), len(taken)
            _step(model, cfg, seed=seed)
            pooled = [n for free in model._get_fsdp_state().ctx.pool._free.values() for n in free]
            assert pooled == [], "buffers kept past the backward"
            model.zero_grad()
            counts.append(len(fresh) - before)
            returned.append(len(taken) - given)
    finally:
        coll.BufferPool.take = orig_take
        coll.BufferPool.give = orig_give
    # the first forward records the order and prefetches nothing, so the
    # first step may need fewer at once than the prefetch runs of the next
    assert 0 < counts[0] <= counts[1] == counts[2], counts
    assert all(c < r for c, r in zip(counts, returned)), (counts, returned)  # reused within the step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@multi_rank(world_sizes=(1, 2))
def test_buffers_are_pooled_on_the_cpu_alone(precision):
    """[Note: reused buffers]: on CUDA the caching allocator reuses freed
    blocks itself, and a pooled buffer would only sit idle in
    max_memory_allocated, so the pool keeps CPU buffers alone. Run as on CUDA
    (``pool_as_on("cuda")``, as the planner runs a CUDA step) the pool hands
    out fresh buffers and keeps none, at one rank (bf16 casts) and two; the
    model trains bit for bit as with the pool, and as PyTorch's fully_shard."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as PTMP
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import MixedPrecisionPolicy
    from shardwise._engine import collectives as coll
    from shardwise.models import GPT, synthetic_batch

    dtype = torch.bfloat16 if precision == "bf16" else None
    kept = []
    orig_give = coll.BufferPool.give

    def give(self, *buffers):
        orig_give(self, *buffers)
        kept.append(sum(len(free) for free in self._free.values()))

    models = {}
    for name, pool_as in (("pooled", None), ("as on cuda", "cuda")):
        model, cfg = _model(mp=MixedPrecisionPolicy(param_dtype=dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kept.clear()
        coll.BufferPool.give = give
        try:
            with coll.pool_as_on(pool_as) if pool_as else contextlib.nullcontext():
                for seed in range(3):
                    _step(model, cfg, seed=seed)
                    opt.step()
                    opt.zero_grad()
        finally:
            coll.BufferPool.give = orig_give
        # one rank in fp32 gathers and reduces in place: no buffer at all
        if precision == "bf16" or torch.distributed.get_world_size() > 1:
            assert kept, "no buffer was given back"
            assert (max(kept) > 0) is (pool_as is None), (name, kept)  # pooled on the CPU alone
        models[name] = model
    torch.manual_seed(0)
    ref = GPT(cfg)
    for block in ref.blocks:
        pt_fully_shard(block, mp_policy=PTMP(param_dtype=dtype))
    pt_fully_shard(ref, mp_policy=PTMP(param_dtype=dtype))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for seed in range(3):
        x, y = synthetic_batch(cfg, 2, seed=seed, rank=torch.distributed.get_rank())
        GPT.loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.full_tensor() for n, p in ref.named_parameters()}
    for name, model in models.items():
        got = {n: p.full_tensor() for n, p in model.named_parameters()}
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), (name, n)


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@multi_rank(world_sizes=(2,))
def test_reduce_scatters_travel_with_the_next_all_gather(precision, runs):
    """[Note: held-back exchanges]: over two gloo ranks a block's reduce-scatter
    is held back and sent with the next all-gather (a bf16 gather beside an fp32
    reduction as bytes), so a step of n resharded blocks and a root takes
    2n + 3 exchanges, not 3n + 2 (prefetch runs off; 2n + 2 once the root's
    gather travels with its prefetch of the first block). With [Note: prefetch
    runs] on, these small blocks' gathers travel together too: one exchange
    in forward, one in backward, and one for the reduce-scatters, held
    until the end of the backward (no run is left to carry them). Training stays bit for bit
    PyTorch's. The packed exchanges' buffers serve again within a backward
    and none is kept after it."""
    import shardwise._engine.prefetch as pg
    import shardwise.comm as comm

    run_bytes = pg._RUN_BYTES
    if not runs:
        pg._RUN_BYTES = 0
    n = 5
    sent = []
    real = comm._exchange

    def counting(send, recv, group):
        sent.append(send)  # held: a fresh buffer cannot take a freed one's id
        return real(send, recv, group)

    def check(step):
        if not runs:
            # after the first forward recorded the order, the root's
            # gather and its prefetch of block 0 travel together
            later = int(step > 0)
            assert len(sent) == 2 * n + 3 - later, (step, len(sent))
            packed = [t for t in sent if t.dtype == torch.uint8]
            assert len(packed) == n - 1 + later, [t.dtype for t in sent]
            assert len({id(t) for t in packed}) < len(packed)  # buffers reused
        else:
            # forward: one exchange (the first forward records the
            # order: one a group); backward: the blocks' gathers in
            # one run, then every reduce-scatter together at its end
            assert len(sent) == (n + 1 if step == 0 else 1) + 2, (step, len(sent))
            assert all(t.dtype == torch.uint8 for t in sent[-2:]), [t.dtype for t in sent]
        assert comm._Flight.live == 0 and not comm._Flight.spare  # none kept

    comm._exchange = counting
    try:
        _train_blocks_alike(precision, n, sent, check)
    finally:
        comm._exchange = real
        pg._RUN_BYTES = run_bytes


def _train_blocks_alike(precision, n, sent, check):
    """Train an n-block GPT under shardwise's and PyTorch's ``fully_shard`` alike
    for 3 steps. ``sent`` (what a test records of shardwise's collectives) is
    cleared before each model's step; ``check(step)`` runs after shardwise's,
    and ``sent`` stays empty through PyTorch's (it calls gloo's collectives).
    Losses and parameters are equal bit for bit."""
    import torch.distributed as dist
    from fsdp_reference import shard_blocks

    from shardwise.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=n, n_heads=2)
    models = []
    for lib in ("shardwise", "torch"):
        torch.manual_seed(0)
        models.append(shard_blocks(GPT(cfg), lib, precision))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
        losses = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            sent.clear()
            loss = GPT.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
            if i == 0:
                check(step)
            else:
                assert not sent
        assert torch.equal(losses[0], losses[1]), (step, losses)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@multi_rank(world_sizes=(4,))
def test_small_gathers_travel_in_runs_over_four_ranks(precision):
    """[Note: held-back exchanges] over more than two ranks: a prefetch run's
    small all-gathers are held and go as one gloo all-gather of their parts
    side by side (bf16 gathers beside fp32 reductions), and the small
    reduce-scatters held until then go as one all-to-all of their rows side
    by side, each summed in gloo's ring order. Training stays bit for bit
    PyTorch's, and no packed buffer is kept after a step."""
    import shardwise.comm as comm

    n = 5
    sent = []
    real_gathers, real_scatters = comm._send_gathers, comm._send_scatters

    def gathers(group, parcels):
        sent.append(("AG", len(parcels)))
        return real_gathers(group, parcels)

    def scatters(group, parcels):
        sent.append(("RS", len(parcels)))
        return real_scatters(group, parcels)

    def check(step):
        # forward: the root's gather with its run of every block (the first
        # forward records the order: one a group); backward: every block in
        # one run (the root stays gathered), then every reduce-scatter
        # together at its end (no run is left to carry them)
        forward = [("AG", n + 1)] if step else [("AG", 1)] * (n + 1)
        assert sent == forward + [("AG", n), ("RS", n + 1)], (step, sent)
        assert comm._Flight.live == 0 and not comm._Flight.spare  # none kept

    comm._send_gathers, comm._send_scatters = gathers, scatters
    try:
        _train_blocks_alike(precision, n, sent, check)
    finally:
        comm._send_gathers, comm._send_scatters = real_gathers, real_scatters


@multi_rank(world_sizes=(4,))
def test_held_gathers_go_before_a_large_one_over_four_ranks():
    """Inside ``exchanges_together`` over four gloo ranks, small all-gathers are
    held; a large one issued after them (300 KiB per rank: above the in-place
    bound of 256 KiB, so one broadcast per rank) sends them first (as over
    two ranks), so the gather waited for first is not queued behind the large
    one. Every output is what gloo's all-gather gives."""
    import torch.distributed as dist

    import shardwise.comm as comm

    group, rank = dist.group.WORLD, dist.get_rank()
    sizes = [1000, 3000, (300 << 10) // 4, 50]  # fp32 elements per rank: two small, one large, one small
    inputs = [torch.arange(n, dtype=torch.float32) + 1e4 * rank + i for i, n in enumerate(sizes)]
    outputs = [torch.empty(4 * n) for n in sizes]
    events = []
    real_send, real_broadcast = comm._send_gathers, dist.broadcast

    def send(g, parcels):
        events.append(("packed", len(parcels)))
        return real_send(g, parcels)

    def broadcast(*args, **kwargs):
        events.append(("broadcast", 1))
        return real_broadcast(*args, **kwargs)

    comm._send_gathers, dist.broadcast = send, broadcast
    try:
        with comm.exchanges_together():
            works = [comm.all_gather_tensor(o, x, group, async_op=True) for o, x in zip(outputs, inputs)]
        for work in works:
            work.wait()
    finally:
        comm._send_gathers, dist.broadcast = real_send, real_broadcast
    assert events == [("packed", 2)] + [("broadcast", 1)] * 4 + [("packed", 1)], events
    for o, x in zip(outputs, inputs):
        want = torch.empty_like(o)
        dist.all_gather_into_tensor(want, x)
        assert torch.equal(o, want)


@multi_rank(world_sizes=(2, 4))
def test_user_collectives_between_held_exchanges():
    """[Note: held-back exchanges]: a user's collective over the same group
    issued in the backward while a reduce-scatter is held (a gradient hook
    that all-reduces) is issued in the same order on every rank: no hang,
    and gradients as PyTorch's (over four ranks too, where the held
    reduce-scatters are all-to-alls)."""
    import torch.distributed as dist
    from fsdp_reference import shard_blocks

    import shardwise.comm as comm
    from shardwise.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=4, n_heads=2)
    x, y = synthetic_batch(cfg, 2, seed=0, rank=dist.get_rank())
    seen = {}
    for lib in ("shardwise", "torch"):
        torch.manual_seed(0)
        model = shard_blocks(GPT(cfg), lib)
        sums, held = [], []

        def hook(grad, sums=sums):
            held.append(any(comm._held.values()))
            total = grad.detach().sum().reshape(1).clone()
            dist.all_reduce(total)  # the default group: the one the blocks are sharded over
            sums.append(total)

        def on_output(mod, args, out):
            out.register_hook(hook)

        for block in model.blocks:
            block.register_forward_hook(on_output)
        GPT.loss(model(x), y).backward()
        seen[lib] = (sums, {n: p.grad.full_tensor() for n, p in model.named_parameters()}, held)
    assert len(seen["shardwise"][0]) == cfg.n_layers
    assert any(seen["shardwise"][2]), "no user collective ran while a reduce-scatter was held"
    for a, b in zip(seen["shardwise"][0], seen["torch"][0]):
        assert torch.equal(a, b)
    for name, grad in seen["shardwise"][1].items():
        assert torch.equal(grad, seen["torch"][1][name]), name


@multi_rank(world_sizes=(2, 3, 4))
def test_gloo_in_place_collectives_equal_gloo_collectives(world_size):
    """[Note: gloo without its copies]: the all-gather and the reduce-scatter
    (any world size) give exactly gloo's results, bit for bit, also
    with several in flight at once and waited out of order, for uneven and
    empty inputs and several dtypes; the engine uses them on gloo and not
    under a dispatch mode (the memory tracker, CommDebugMode)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import shardwise.comm as comm
    from shardwise.planner import MemoryTracker

    group = dist.group.WORLD
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    # reduce-scatters at every size; all-gathers too over two ranks, over
    # more by default from 256 KiB sent per rank (300,000 floats are 1.2 MB);
    # small all-gathers too here
    big = torch.zeros(world_size * 300_000)
    for n, in_place in ((300_000, True), (10, world_size == 2)):
        work = comm.all_gather_tensor(torch.empty(world_size * n), big[:n], group, True)
        assert isinstance(work, comm._Works) == in_place, (n, type(work))
        work.wait()
        work = comm.reduce_scatter_tensor(torch.empty(n), big[: world_size * n], group, dist.ReduceOp.SUM, True)
        assert isinstance(work, comm._Works), (n, type(work))
        work.wait()
    default_min, comm._IN_PLACE_MIN_BYTES = comm._IN_PLACE_MIN_BYTES, 0
    cases = [(n, dtype) for n in (0, 1, 7, 1000, 300_000) for dtype in (torch.float32, torch.bfloat16)]
    cases.append((5, torch.uint8))
    pending = []
    for n, dtype in cases:
        x = (torch.randn(n, generator=gen) * 1e3).to(dtype)
        out = torch.full((world_size * n,), -1.0).to(dtype)
        pending.append(("AG", x, out, comm.all_gather_tensor(out, x, group, async_op=True)))
        if dtype != torch.uint8:
            g = (torch.randn(world_size * n, generator=gen) * 1e3).to(dtype)
            rs_out = torch.full((n,), -1.0).to(dtype)
            work = comm.reduce_scatter_tensor(rs_out, g, group, dist.ReduceOp.SUM, async_op=True)
            pending.append(("RS", g, rs_out, work))
    assert all(isinstance(w, comm._Works) for *_, w in pending)
    for kind, x, out, work in reversed(pending):  # waited out of issue order
        work.wait()
        expected = torch.empty_like(out)
        if kind == "AG":
            dist.all_gather_into_tensor(expected, x)
        else:
            dist.reduce_scatter_tensor(expected, x)
        assert torch.equal(out, expected), (kind, x.numel(), x.dtype)

    used = []
    real = comm.gloo_all_gather

    def counting(*args):
        used.append(1)
        return real(*args)

    comm.gloo_all_gather = counting
    try:
        model, cfg = _model()
        _step(model, cfg)
        assert used, "the engine did not take the in-place path on gloo"
        used.clear()
        with MemoryTracker():
            _step(model, cfg, seed=1)
        assert not used, "in-place path under a memory tracker"
        with CommDebugMode() as mode:  # as PyTorch's own FSDP tests count
            _step(model, cfg, seed=2)
        assert not used, "in-place path under CommDebugMode"
        counts = mode.get_comm_counts()
        c10d = torch.ops.c10d
        assert counts[c10d._allgather_base_] == 2 * N_LAYERS + 1, counts  # forward + backward, root kept
        assert counts[c10d._reduce_scatter_base_] == N_LAYERS + 1, counts
    finally:
        comm.gloo_all_gather = real
        comm._IN_PLACE_MIN_BYTES = default_min


@multi_rank(world_sizes=(3, 4))
def test_reduce_scatter_sums_in_gloos_ring_order(world_size):
    """[Note: gloo's ring order]: over more than two ranks the reduce-scatter
    (an all-to-all and a sum here) adds each element's rows in the order
    gloo's ring does, so its results are gloo's bit for bit: sizes whose ring
    chunks fall off the rows, with one to ten 1 MiB segments per rank, fp32
    and bf16, values over many magnitudes (so any other order would show).
    Issued together and waited out of order, the small ones are held and
    travel as one all-to-all of their rows side by side ([Note: held-back
    exchanges]); a large one sends those held before it first."""
    import torch.distributed as dist

    import shardwise.comm as comm

    group, rank = dist.group.WORLD, dist.get_rank()

    def case(n, dtype):
        gen = torch.Generator().manual_seed(1000 * rank + n)
        x = torch.randn(world_size * n, generator=gen) * torch.exp(4 * torch.randn(world_size * n, generator=gen))
        gloos = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(gloos, x.to(dtype))
        return x.to(dtype), gloos

    other_order = 0
    for n in (1, 3, 4097, 65_537, 524_289, 1_000_001, 2_500_003):
        for dtype in (torch.float32, torch.bfloat16):
            x, gloos = case(n, dtype)
            ours = torch.full((n,), -1.0, dtype=dtype)
            work = comm.reduce_scatter_tensor(ours, x, group, dist.ReduceOp.SUM, async_op=True)
            assert isinstance(work, comm._Works)
            work.wait()
            assert torch.equal(ours.view(torch.uint8), gloos.view(torch.uint8)), (n, dtype)
            rows = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(rows, x)
            in_rank_order = torch.stack([r.view(world_size, n)[rank] for r in rows]).sum(0, dtype=dtype)
            other_order += int((in_rank_order != gloos).sum())
    assert other_order > 1000, "the values do not tell one order of the sum from another"

    sent = []
    real = comm._send_scatters

    def counting(g, parcels):
        sent.append(len(parcels))
        return real(g, parcels)

    comm._send_scatters = counting
    try:
        cases = [(n, dtype) for n in (1, 3, 4097, 65_537, 7) for dtype in (torch.float32, torch.bfloat16)]
        pending = []
        for n, dtype in cases:
            x, gloos = case(n, dtype)
            ours = torch.full((n,), -1.0, dtype=dtype)
            pending.append((ours, gloos, comm.reduce_scatter_tensor(ours, x, group, dist.ReduceOp.SUM, True)))
        for ours, gloos, work in reversed(pending):
            work.wait()
            assert torch.equal(ours.view(torch.uint8), gloos.view(torch.uint8)), ours.numel()
    finally:
        comm._send_scatters = real
    # the six small ones before the 256 KiB fp32 one, then it alone; the bf16
    # one (128 KiB) and the last two are sent when the first of them is waited for
    assert sent == [6, 1, 3], sent


@pytest.mark.parametrize("bound", [None, 1, 2])
@multi_rank(world_sizes=(2,))
def test_prefetch_runs_keep_a_set_reduce_scatter_bound(bound):
    """[Note: prefetch runs]: by default a run's reduce-scatters wait to travel
    with the next run (more than one in flight); set_reduce_scatter_max_input_buffers
    still bounds them, as set (that many besides the one just issued)."""
    from shardwise._engine.param_group import ParamGroup

    model, cfg = _model(n_layers=5)
    if bound is not None:
        model.set_reduce_scatter_max_input_buffers(bound)
    peak = [0]
    orig = ParamGroup._start_reduction

    def start(self, *args):
        peak[0] = max(peak[0], len(self.ctx.pending) + 1)
        return orig(self, *args)

    ParamGroup._start_reduction = start
    try:
        for seed in range(2):
            _step(model, cfg, seed)
    finally:
        ParamGroup._start_reduction = orig
    if bound is None:
        assert peak[0] > 2, peak
    else:
        assert peak[0] == bound + 1, peak
