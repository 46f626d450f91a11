"""The README's "Composes with" examples run as written (on the ranks of the
test pool, whose process group stands in for torchrun's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardwise.testing import multi_rank

README = Path(__file__).resolve().parents[2] / "README.md"


def _examples() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Composes with") : text.index("## The main job")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@multi_rank(world_sizes=(4,))
def test_fsdp_tp_compile_example():
    import torch
    import torch.distributed as dist

    code = _examples()[0]
    assert "init_device_mesh" in code and code.rstrip().endswith("dist.destroy_process_group()")
    code = code.rstrip().removesuffix("dist.destroy_process_group()")  # the pool's group lives on
    scope: dict = {}
    try:
        exec(compile(code, "README.md (Composes with)", "exec"), scope)
    finally:
        torch._dynamo.reset()
    model, loss = scope["model"], scope["loss"]
    w = model.blocks[0].mlp[0].weight
    assert [type(p).__name__ for p in w.placements] == ["_StridedShard", "Shard"]
    assert torch.isfinite(loss)
    # the two TP ranks of a dp rank computed the same loss; the dp ranks differ
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss.item())
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2], losses


@multi_rank(world_sizes=(2,))
def test_float8_example():
    pytest.importorskip("torchao")
    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from shardwise import fully_shard
    from shardwise.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(tie_embeddings=False)
    scope = {"model": GPT(cfg), "fully_shard": fully_shard}
    exec(compile(_examples()[1], "README.md (float8)", "exec"), scope)
    model = scope["model"]
    assert type(model.blocks[0].mlp[0].weight.to_local()) is WeightWithDynamicFloat8CastTensor
    x, y = synthetic_batch(cfg, 4, seed=0)
    loss = GPT.loss(model(x), y)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].mlp[0].weight.grad is not None
