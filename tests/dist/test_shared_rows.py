"""Two ranks of one host exchanging rows through shared memory
(``SHARDWISE_SHARED_MEMORY=1``, [Note: shared rows] in ``shardwise/shared_rows.py``)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from shardwise.testing import multi_rank


@contextlib.contextmanager
def _shared_memory(on: bool | None = True):
    """The setting on, off ("0") or, with None, not set at all."""
    from shardwise import shared_rows

    old = os.environ.get(shared_rows.ENV)
    if on is None:
        os.environ.pop(shared_rows.ENV, None)
    else:
        os.environ[shared_rows.ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(shared_rows.ENV, None)
        else:
            os.environ[shared_rows.ENV] = old


def _ours_in_dev_shm() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("shardwise")]


def _train_like_pytorch(precision: str, steps: int = 3):
    """A 3-block GPT whose blocks' rows are above MIN_BYTES (1.5 MiB a rank
    in fp32), trained under shardwise's and PyTorch's ``fully_shard`` alike:
    losses and parameters equal bit for bit. Returns shardwise's model."""
    import torch.distributed as dist
    from fsdp_reference import shard_blocks

    from shardwise.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=256, n_layers=3, n_heads=4)
    models = []
    for lib in ("shardwise", "torch"):
        torch.manual_seed(0)
        models.append(shard_blocks(GPT(cfg), lib, precision))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
        losses = []
        for model, opt in zip(models, opts):
            loss = GPT.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1]), (step, losses)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    return models[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@multi_rank(world_sizes=(2, 3, 4))
def test_shared_rows_train_bit_for_bit_like_pytorch(precision):
    """With the setting on, every large all-gather and reduce-scatter of the
    step goes through shared memory (only descriptors over gloo; over more
    than two ranks each reduce-scatter summed in gloo's ring order), training
    is bit for bit PyTorch's, and no file is left in /dev/shm."""
    import torch.distributed as dist

    from shardwise import shared_rows

    before = shared_rows.existing(dist.group.WORLD)
    done_before = 0 if before is None else before.exchanges  # workers outlive a test
    with _shared_memory():
        _train_like_pytorch(precision)
    rows = shared_rows.existing(dist.group.WORLD)
    assert rows is not None
    # 3 steps of the 3 blocks' gathers in forward and again in backward and
    # their reduce-scatters (the root's rows are below MIN_BYTES: over gloo)
    assert rows.exchanges - done_before == 3 * 9, rows.exchanges
    assert len(rows.mine) <= 8, len(rows.mine)  # buffers are reused, not made per exchange
    assert not _ours_in_dev_shm()  # anonymous memory: no names


@multi_rank(world_sizes=(2, 3))
def test_a_shared_buffer_waits_for_every_other_rank_to_read_it():
    """A buffer given back is not handed out again while any other rank has
    not read its last exchange: another one is made; once every other rank
    read it, it is handed out again."""
    import torch.distributed as dist

    from shardwise import shared_rows

    group, me, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    rows = shared_rows._setup(group)
    assert rows is not None
    n = 1 << 16
    buf = rows.take(n)
    buf.view(torch.int32).fill_(100 + me)
    desc = rows.describe(buf)
    assert desc is not None
    every = torch.zeros(size, desc.numel(), dtype=desc.dtype)
    every[me] = desc
    dist.all_reduce(every)

    def read_rank_0():
        descs = rows.check(every)
        got = rows.read(descs[0], torch.empty(n // 4, dtype=torch.int32), 0)
        assert torch.equal(got, torch.full((n // 4,), 100, dtype=torch.int32))
        rows.done(descs)  # marks every other rank's buffer read; only rank 0's is checked here

    if 0 < me < size - 1:
        read_rank_0()  # all but the last rank read rank 0's buffer now
    dist.barrier()
    if me == 0:
        rows.give(buf)
        again = rows.take(n)
        assert again.data_ptr() != buf.data_ptr()  # the last rank has not read buf yet
        again.view(torch.int32).fill_(-1)
        rows.give(again)
    dist.barrier()
    if me == size - 1:
        read_rank_0()
    dist.barrier()
    if me == 0:
        assert rows.take(n).data_ptr() == buf.data_ptr()  # read by every rank now: handed out again


@multi_rank(world_sizes=(2,))
def test_a_group_that_cannot_share_stays_on_gloo():
    """Where one rank cannot open the other's memory (another host, another
    process namespace), both ranks agree at set-up, exchange over gloo as
    before, and train bit for bit PyTorch's."""
    import torch.distributed as dist

    from shardwise import shared_rows

    shared_rows._groups.pop(dist.group.WORLD, None)  # set up anew (workers outlive a test)
    real_open = shared_rows._open
    if dist.get_rank() == 1:
        shared_rows._open = lambda pid, fd, nbytes: None
    try:
        with _shared_memory():
            _train_like_pytorch("fp32", steps=2)
    finally:
        shared_rows._open = real_open
    assert shared_rows.existing(dist.group.WORLD) is None


@multi_rank(world_sizes=(2,))
def test_off_by_default():
    """Without the setting in the environment, no group sets shared memory up."""
    import torch.distributed as dist

    from shardwise import shared_rows

    shared_rows._groups.pop(dist.group.WORLD, None)  # workers outlive a test
    assert shared_rows.existing(dist.group.WORLD) is None
    with _shared_memory(on=None):
        _train_like_pytorch("fp32", steps=1)
    assert shared_rows.existing(dist.group.WORLD) is None



@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@multi_rank(world_sizes=(2, 3))
def test_a_rank_that_cannot_make_shared_memory_fails_every_rank_alike(collective):
    """A rank that cannot make a shared buffer for an exchange (here: no
    memory left for it) still sends a descriptor, one that says why, so
    every rank of the group raises the same error at that exchange, naming
    the rank, the reason and the setting; none waits on a peer that left."""
    import errno

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from shardwise import MixedPrecisionPolicy, fully_shard, shared_rows
    from shardwise.models import GPT, GPTConfig, synthetic_batch

    group = dist.new_group(list(range(dist.get_world_size())))  # its own: it is left mid-exchange
    mesh = DeviceMesh.from_group(group, "cpu")
    # bf16 gathers of 1.6 MB a block, fp32 reduce-scatters of 3.2 MB
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=256, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    x, y = synthetic_batch(cfg, 2, seed=0, rank=dist.get_rank())
    real_create = shared_rows._create
    fails_from = shared_rows.MIN_BYTES if collective == "all_gather" else 2 << 20

    def no_memory(nbytes):
        if nbytes >= fails_from:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_create(nbytes)

    with _shared_memory():
        assert shared_rows.for_group(group) is not None  # set up (a collective) before any buffer fails
        if dist.get_rank() == 1:
            shared_rows._create = no_memory
        try:
            forward_done = False
            with pytest.raises(RuntimeError) as caught:
                loss = GPT.loss(model(x), y)
                forward_done = True
                assert collective == "reduce_scatter", "the forward's gathers should have failed"
                loss.backward()
        finally:
            shared_rows._create = real_create
    assert forward_done == (collective == "reduce_scatter")  # the reduce-scatter's buffer failed in backward
    text = str(caught.value)
    assert "rank 1: No space left on device" in text and f"{shared_rows.ENV}=0" in text, text
    assert not any(f"rank {r}:" in text for r in range(dist.get_world_size()) if r != 1), text
