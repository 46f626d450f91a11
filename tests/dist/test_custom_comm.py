"""Custom collectives: every buffer from allocate, every collective through the
call, results bitwise identical to the default path; misbehaving ones fail
clearly without corrupting anything; the int8 all-gather trains closely."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _build(n_layers=2, mp=None):
    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=37, seq_len=8, dim=16, n_layers=n_layers, n_heads=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    kw = {"mp_policy": mp or MixedPrecisionPolicy()}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model, cfg


def _fsdp_modules(model):
    from shardwise import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _train(model, cfg, steps=3):
    from shardwise.models import GPT, synthetic_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
        loss = GPT.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, opt


def _assert_identical(model_a, model_b):
    for (na, a), (nb, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert na == nb and torch.equal(a.to_local(), b.to_local()), na


class _Tracked:
    """Mixin: remembers the buffers it allocated and checks each call uses them."""

    def __init__(self, sync=False):
        self.sync = sync
        self.allocs = []  # (numel, dtype)
        self.calls = 0
        self.ptrs = set()
        self.groups = set()

    def allocate(self, size, *, dtype, device):
        buf = torch.empty(*size, dtype=dtype, device=device)
        self.allocs.append((buf.numel(), dtype))
        self.ptrs.add(buf.data_ptr())
        return buf

    def _check(self, out, inp, group, in_place=False):
        assert out.data_ptr() in self.ptrs, "output not from allocate"
        if in_place:  # an all-gather's input is this rank's row of its output, as in PyTorch's FSDP
            row = out.numel() // dist.get_world_size(group)
            assert inp.data_ptr() == out.data_ptr() + dist.get_rank(group) * row * out.element_size()
        else:
            assert inp.data_ptr() in self.ptrs, "input not from allocate"
        self.calls += 1
        self.groups.add(id(group))


def _recording_classes():
    from shardwise import AllGather, ReduceScatter

    class RecordingAllGather(_Tracked, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self._check(output_tensor, input_tensor, group, in_place=True)
            assert output_tensor.numel() == input_tensor.numel() * dist.get_world_size(group)
            work = _all_gather(output_tensor, input_tensor, group=group, async_op=async_op and not self.sync)
            return None if self.sync else work

    class RecordingReduceScatter(_Tracked, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self._check(output_tensor, input_tensor, group)
            assert op == dist.ReduceOp.SUM
            work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op and not self.sync)
            return None if self.sync else work

    return RecordingAllGather, RecordingReduceScatter


@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@multi_rank(world_sizes=(2,))
def test_recording_collectives_bitwise_identical(sync, precision):
    from shardwise import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    RecAG, RecRS = _recording_classes()
    ref, cfg = _build(mp=mp)
    model, _ = _build(mp=mp)
    comms = []
    for m in _fsdp_modules(model):
        ag, rs = RecAG(sync), RecRS(sync)
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        comms.append((m, ag, rs))
    ref_losses, _ = _train(ref, cfg)
    losses, _ = _train(model, cfg)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    _assert_identical(model, ref)
    gather_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for m, ag, rs in comms:
        shard_group = m._get_fsdp_state().group.info.shard_group
        assert ag.groups == {id(shard_group)} and rs.groups == {id(shard_group)}
        is_root = m is model
        # 3 steps: root gathers once per step, blocks twice (forward + backward)
        assert ag.calls == 3 * (1 if is_root else 2), (type(m).__name__, ag.calls)
        assert rs.calls == 3
        assert {dt for _, dt in ag.allocs} == {gather_dtype}
        assert {dt for _, dt in rs.allocs} == {torch.float32}
        # an all-gather allocates its output only (as PyTorch's FSDP); a reduce-scatter input + output
        assert len(ag.allocs) == ag.calls and len(rs.allocs) == 2 * rs.calls


@multi_rank(world_sizes=(2,))
def test_persistent_buffer_collectives_reuse_one_buffer():
    from shardwise import AllGather, ReduceScatter

    class Persistent:
        def __init__(self):
            self.buffers = {}
            self.ptrs = []

        def allocate(self, size, *, dtype, device):
            key = (tuple(size), dtype)
            if key not in self.buffers:
                self.buffers[key] = torch.empty(*size, dtype=dtype, device=device)
            self.ptrs.append(self.buffers[key].data_ptr())
            return self.buffers[key]

    class PAG(Persistent, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)

    class PRS(Persistent, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    ref, cfg = _build()
    model, _ = _build()
    comms = []
    for m in _fsdp_modules(model):
        ag, rs = PAG(), PRS()
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        comms += [ag, rs]
    ref_losses, _ = _train(ref, cfg, steps=4)
    losses, _ = _train(model, cfg, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    _assert_identical(model, ref)
    for comm in comms:
        # reused every step: an all-gather's output (its input is a row of it), a reduce-scatter's input + output
        assert len(comm.ptrs) >= 4 and len(set(comm.ptrs)) == (1 if isinstance(comm, PAG) else 2)


@pytest.mark.parametrize("failure", ["raise_all_gather", "wrong_shape", "wrong_dtype", "raise_reduce_scatter"])
@multi_rank(world_sizes=(2,))
def test_misbehaving_collective_fails_clearly_without_corruption(failure):
    from shardwise import AllGather, ReduceScatter
    from shardwise.comm import DefaultAllGather, DefaultReduceScatter
    from shardwise.errors import CollectiveError
    from shardwise.models import GPT, synthetic_batch

    class BadAG(DefaultAllGather):
        def allocate(self, size, *, dtype, device):
            if failure == "wrong_shape":
                return torch.empty(size[0] + 1, dtype=dtype, device=device)
            if failure == "wrong_dtype":
                return torch.empty(*size, dtype=torch.float64, device=device)
            return super().allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if failure == "raise_all_gather":
                raise RuntimeError("link down")
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class BadRS(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            raise RuntimeError("link down")

    assert isinstance(BadAG(), AllGather) and isinstance(BadRS(), ReduceScatter)
    ref, cfg = _build()
    model, _ = _build()
    _, ref_opt = _train(ref, cfg, steps=1)
    _, opt = _train(model, cfg, steps=1)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    state_before = copy.deepcopy(opt.state_dict())
    block = model.blocks[1]
    if failure == "raise_reduce_scatter":
        block.set_custom_reduce_scatter(BadRS())
    else:
        block.set_custom_all_gather(BadAG())
    x, y = synthetic_batch(cfg, 2, seed=7, rank=dist.get_rank())
    hook = "ReduceScatter" if failure == "raise_reduce_scatter" else "AllGather"
    with pytest.raises(CollectiveError, match=rf"blocks\.1: .*{hook}") as info:
        GPT.loss(model(x), y).backward()
    assert isinstance(info.value, RuntimeError)
    # nothing the optimizer owns was touched (the module may still hold
    # unsharded parameters mid-iteration: compare the optimizer's shards)
    for (n, _), p in zip(before.items(), opt.param_groups[0]["params"]):
        assert torch.equal(p.to_local(), before[n]), n
    assert str(opt.state_dict()) == str(state_before)
    # recover: reset the iteration, restore the default collective, keep training in step
    model.reset_iter_state()
    opt.zero_grad()
    block.set_custom_all_gather(DefaultAllGather())
    block.set_custom_reduce_scatter(DefaultReduceScatter())
    for step in range(2):
        x, y = synthetic_batch(cfg, 2, seed=10 + step, rank=dist.get_rank())
        la = GPT.loss(model(x), y)
        la.backward()
        lb = GPT.loss(ref(x), y)
        lb.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        assert torch.equal(la, lb)
    _assert_identical(model, ref)


@multi_rank(world_sizes=(2,))
def test_quantized_all_gather_trains_close_to_exact():
    from shardwise import QuantizedAllGather

    ref, cfg = _build(n_layers=2)
    model, _ = _build(n_layers=2)
    comms = [QuantizedAllGather(block_size=64) for _ in _fsdp_modules(model)]
    for m, comm in zip(_fsdp_modules(model), comms):
        m.set_custom_all_gather(comm)
    steps = 30
    ref_losses, _ = _train(ref, cfg, steps=steps)
    losses, _ = _train(model, cfg, steps=steps)
    ref_l, l = torch.stack(ref_losses), torch.stack(losses)
    assert not torch.equal(ref_l, l)  # it really is approximate
    rel = (l - ref_l).abs() / ref_l
    # Stated tolerance: the first 10 steps track the exact run within 1.5%; after
    # that AdamW's trajectory drifts, but the loss level of the last 10 steps
    # stays within 5% of the exact run's, and falls as much.
    assert rel[:10].max() < 0.015, rel
    assert abs(l[-10:].mean() - ref_l[-10:].mean()) / ref_l[-10:].mean() < 0.05, (l, ref_l)
    assert l[-10:].mean() < 0.9 * l[:5].mean()
    sent = sum(c.bytes_sent for c in comms)
    full = sum(c.bytes_uncompressed for c in comms)
    assert 0.25 < sent / full < 0.30, sent / full  # int8 + one fp32 scale per 64 values
    # shards themselves stay full precision
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the gathered copy is off by at most half a quantisation step; blocks span
    # parameter boundaries in the group's flat buffer, so bound by the group max
    block = model.blocks[0]
    exact = {n: p.full_tensor().detach() for n, p in block.named_parameters()}
    step = max(t.abs().max() for t in exact.values()) / 127
    block.unshard()
    errors = {n: (p.detach() - exact[n]).abs().max() for n, p in block.named_parameters()}
    block.reshard()
    assert all(err <= step / 2 * 1.001 for err in errors.values()), (errors, step)
    assert any(err > 0 for err in errors.values())
