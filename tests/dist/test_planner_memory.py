"""The planner's per-rank model-state bytes equal what a sharded model's
ranks actually hold after a training step (parameters, gradients, AdamW
state), over world sizes that do and do not divide the parameter rows."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank


@pytest.mark.parametrize("wrap", ["blocks", "root"])
@multi_rank(world_sizes=(2, 3))
def test_planner_matches_measured_local_bytes(world_size, wrap):
    import torch.distributed as dist

    from shardwise import fully_shard
    from shardwise.models import GPT, GPTConfig, synthetic_batch
    from shardwise.planner import estimate_memory, groups_of, unsharded_model_state
    from shardwise.train.loop import state_bytes

    cfg = GPTConfig(vocab_size=61, seq_len=8, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)
    with torch.device("meta"):  # planned before anything is allocated
        meta = GPT(cfg)
    groups = groups_of(meta, list(meta.blocks) if wrap == "blocks" else [])
    torch.manual_seed(0)
    model = GPT(cfg)
    wrapped = list(model.blocks) if wrap == "blocks" else []
    for block in wrapped:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(cfg, 2, seed=0, rank=dist.get_rank())
    GPT.loss(model(x), y).backward()
    optim.step()
    held, full = state_bytes(model, optim)
    est = estimate_memory(groups, shard_size=world_size, rank=dist.get_rank())
    assert held == est.model_state
    assert full == unsharded_model_state(groups)
    # the uneven split is visible: ranks hold different amounts when rows do not divide
    sizes = [None] * world_size
    dist.all_gather_object(sizes, held)
    assert sum(sizes) == full
