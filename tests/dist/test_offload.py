"""CPUOffloadPolicy on a CPU-only machine: the compute device is the CPU too,
so offload must keep its contract (shards, gradients and optimizer state on
the CPU) and train exactly like no offload."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank


def _build(offload_blocks, offload_root, pin_memory=True):
    from shardwise import CPUOffloadPolicy, OffloadPolicy, fully_shard
    from shardwise.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=37, seq_len=8, dim=16, n_layers=2, n_heads=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    for block in model.blocks:
        fully_shard(block, offload_policy=policy if offload_blocks else OffloadPolicy())
    fully_shard(model, offload_policy=policy if offload_root else OffloadPolicy())
    return model, cfg


def _train(model, cfg, steps=3):
    from shardwise.models import GPT, synthetic_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
        loss = GPT.loss(model(x), y)
        loss.backward()
        if step == steps - 1:
            for p in model.parameters():
                assert p.grad.device.type == "cpu" and p.grad.to_local().device.type == "cpu"
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, opt


@pytest.mark.parametrize("layout", ["all", "blocks_only", "root_only"])
@multi_rank(world_sizes=(2,))
def test_offload_matches_no_offload_bitwise(layout):
    ref, cfg = _build(False, False)
    model, _ = _build(layout in ("all", "blocks_only"), layout in ("all", "root_only"))
    ref_losses, _ = _train(ref, cfg)
    losses, opt = _train(model, cfg)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()), n
        assert p.to_local().device.type == "cpu"
    for state in opt.state.values():
        for v in state.values():
            assert v.device.type == "cpu"


@multi_rank(world_sizes=(2,))
def test_pin_memory_is_a_no_op_without_accelerator():
    model, cfg = _build(True, True, pin_memory=True)
    _train(model, cfg, steps=1)
    groups = [s.group for s in __import__("shardwise._engine.module_state", fromlist=["x"]).states_under(model)]
    for g in groups:
        assert g.flat_sharded is not None and g.flat_sharded.is_pinned() == torch.cuda.is_available()
