"""The planner's memory formula: arithmetic, grouping, and its dependencies
(policies and torch only). The check against measured bytes of a sharded
model is tests/dist/test_planner_memory.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy
from shardwise.models import GPT, GPTConfig
from shardwise.planner import GroupSpec, ParamSpec, estimate_memory, groups_of, shard_numel, unsharded_model_state


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 10])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_shard_numel_matches_torch_chunk(rows, shards):
    full = torch.empty(rows, 5)
    chunks = torch.chunk(full, shards) if rows else ()
    for r in range(shards):
        expected = chunks[r].numel() if r < len(chunks) else 0
        assert shard_numel((rows, 5), shards, r) == expected
    assert shard_numel((4, 6), 4, 1, dim=1) == torch.chunk(torch.empty(4, 6), 4, dim=1)[1].numel()


def test_shard_numel_rejects_bad_index():
    with pytest.raises(ValueError, match="shard_index=2"):
        shard_numel((4,), 2, 2)


def _meta_gpt(**kw):
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, seq_len=8, dim=16, n_layers=3, n_heads=2, **kw))


def test_groups_mirror_fully_shard_and_count_tied_weights_once():
    model = _meta_gpt()
    groups = groups_of(model, list(model.blocks))
    assert [g.is_root for g in groups] == [False, False, False, True]
    assert groups[0].name == "blocks.0"
    assert sum(g.numel for g in groups) == model.num_params()
    root = groups[-1]
    # tok_emb (tied with lm_head, once), pos_emb, final norm
    assert root.numel == 64 * 16 + 8 * 16 + 2 * 16
    whole = groups_of(model, [])
    assert len(whole) == 1 and whole[0].numel == model.num_params()


def test_formula_by_hand():
    a = GroupSpec("a", (ParamSpec((10, 4), torch.float32),))  # 40 elements
    b = GroupSpec("b", (ParamSpec((6,), torch.float32),))  # 6
    c = GroupSpec("c", (ParamSpec((2, 2), torch.float32),))  # 4
    root = GroupSpec("<root>", (ParamSpec((3, 2), torch.float32),), is_root=True)  # 6
    groups = [a, b, c, root]
    # rank 1 of 4: chunk(10 rows)=[3,3,3,1] -> 3 rows x 4; chunk(6)=[2,2,2] -> 2; chunk(2 rows)=[1,1] -> 1 row x 2;
    # chunk(3 rows)=[1,1,1] -> 1 row x 2
    est = estimate_memory(groups, shard_size=4, rank=1)
    local = 12 + 2 + 2 + 2
    assert est.sharded_params == est.sharded_grads == 4 * local
    assert est.optimizer_state == 2 * 4 * local
    assert est.unsharded_peak == 4 * (40 + 6)  # largest two non-root groups
    assert est.root_unsharded == 4 * 6
    assert est.total == 4 * local * 4 + 4 * 46 + 24 and est.device == est.total
    # rank 3: chunk(10)[3] = 1 row, chunk(6) has 3 chunks -> empty, chunk(2 rows)[3] empty
    assert estimate_memory(groups, shard_size=4, rank=3).sharded_params == 4 * 4
    # shard grad op keeps every non-root group whole; int reshard keeps 1/k of the rest
    assert estimate_memory(groups, shard_size=4, reshard_after_forward=False).unsharded_peak == 4 * 50
    assert estimate_memory(groups, shard_size=4, reshard_after_forward=2).unsharded_peak == 4 * 46 + 4 * 4 // 2
    # bf16 halves the unsharded terms only; offload moves the model state off the device
    mp = estimate_memory(groups, shard_size=4, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert mp.unsharded_peak == 2 * 46 and mp.root_unsharded == 12 and mp.sharded_params == est.sharded_params
    off = estimate_memory(groups, shard_size=4, offload_policy=CPUOffloadPolicy())
    assert off.device == off.unsharded_peak + off.root_unsharded
    # hybrid: shard index = rank % shard_size
    assert estimate_memory(groups, shard_size=2, rank=3) == estimate_memory(groups, shard_size=2, rank=1).__class__(
        **{**estimate_memory(groups, shard_size=2, rank=1).__dict__, "rank": 3})
    assert unsharded_model_state(groups) == 4 * 4 * 56


def test_bad_arguments_name_the_fix():
    g = [GroupSpec("<root>", (ParamSpec((2,), torch.float32),), is_root=True)]
    with pytest.raises(ValueError, match="shard_size=0"):
        estimate_memory(g, shard_size=0)
    with pytest.raises(TypeError, match="groups_of"):
        estimate_memory([], shard_size=1)


def test_planner_depends_on_the_bottom_layer_and_torch_only():
    import shardwise.planner

    for path in Path(shardwise.planner.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("shardwise"):
                    assert name in (
                        "shardwise.policies", "shardwise.layout", "shardwise.observe", "shardwise.planner.memory",
                        "shardwise.planner.simulate", "shardwise.planner.tracker",
                    ), (path.name, name)
