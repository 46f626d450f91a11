"""CUDA-only checks (NCCL at world size 1): the engine on a GPU, CPU offload
with compute on CUDA, and that collectives are asynchronous (prefetch in
flight while the previous module computes). Skipped without CUDA."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", autouse=True)
def nccl_world():
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_device(0)
    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _gpt(device="cuda"):
    from shardwise.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=32, dim=64, n_layers=3, n_heads=4)
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg), cfg


def _shard(model, **kw):
    from shardwise import fully_shard

    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _train(model, cfg, steps=3):
    from shardwise.models import GPT, synthetic_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, 4, seed=step)
        loss = GPT.loss(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fully_shard_on_cuda_matches_local():
    ref, cfg = _gpt()
    model = copy.deepcopy(ref)
    _shard(model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    torch.testing.assert_close(_train(model, cfg), _train(ref, cfg))


def test_bf16_on_cuda():
    from shardwise import MixedPrecisionPolicy

    model, cfg = _gpt()
    _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    losses = _train(model, cfg, steps=5)
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_no_buffer_is_pooled_on_cuda():
    """[Note: reused buffers]: on CUDA the caching allocator reuses freed
    blocks, so the pool keeps none (idle pooled casts once stood 114 MiB
    above PyTorch's max_memory_allocated on an H200). A bf16 step at world
    size 1 casts into buffers; none is held after forward or backward (on
    the CPU the same step holds some after forward)."""
    from shardwise import MixedPrecisionPolicy
    from shardwise.models import GPT, synthetic_batch

    model, cfg = _gpt()
    _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    held = []
    for step in range(2):
        x, y = synthetic_batch(cfg, 4, seed=step)
        out = model(x.cuda())
        pool = model._get_fsdp_state().ctx.pool
        held.append(pool.nbytes)
        GPT.loss(out, y.cuda()).backward()
        held.append(pool.nbytes)
    assert held == [0, 0, 0, 0], held


def test_cpu_offload_compute_on_cuda():
    from shardwise import CPUOffloadPolicy

    ref, cfg = _gpt()
    model = copy.deepcopy(ref).cpu()
    _shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    for p in model.parameters():
        assert p.to_local().device.type == "cpu"
    from shardwise._engine.module_state import states_under

    assert all(s.group.flat_sharded.is_pinned() for s in states_under(model))
    torch.testing.assert_close(_train(model, cfg), _train(ref, cfg), rtol=1e-4, atol=1e-4)
    for p in model.parameters():
        assert p.to_local().device.type == "cpu"


def test_cpu_offload_gradients_accumulate_on_cuda():
    """Offloaded gradients reach the host in one asynchronous copy per
    reduction into pinned memory: the second backward's accumulation and the
    optimizer read them only once the copy has landed."""
    from shardwise import CPUOffloadPolicy
    from shardwise.models import GPT, synthetic_batch

    ref, cfg = _gpt()
    model = copy.deepcopy(ref).cpu()
    _shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    for step in range(2):  # two micro-batches, gradients summed
        x, y = synthetic_batch(cfg, 4, seed=step)
        GPT.loss(model(x.cuda()), y.cuda()).backward()
        GPT.loss(ref(x.cuda()), y.cuda()).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.to_local().device.type == "cpu" and p.grad.to_local().is_pinned(), name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad.cpu(), rtol=1e-4, atol=1e-5, msg=name)


def test_prefetch_is_in_flight_while_previous_block_computes():
    model, cfg = _gpt()
    _shard(model)
    _train(model, cfg, steps=1)  # records the forward order
    seen = []
    for i, block in enumerate(model.blocks[:-1]):
        nxt = model.blocks[i + 1]._get_fsdp_state().group

        def hook(mod, args, nxt=nxt):
            seen.append(nxt._in_flight is not None or nxt.is_unsharded)

        block.register_forward_pre_hook(hook)
    _train(model, cfg, steps=1)
    assert seen and all(seen)


def test_quantized_all_gather_on_cuda():
    from shardwise import FSDPModule, QuantizedAllGather

    ref, cfg = _gpt()
    model = copy.deepcopy(ref)
    _shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(QuantizedAllGather())
    a, b = _train(model, cfg, steps=3), _train(ref, cfg, steps=3)
    assert abs(a[0] - b[0]) / b[0] < 0.01


_PLAN_VS_CUDA = """
import json, sys
sys.path.insert(0, sys.argv[1])
import bench_plan
name = "gpt fp32, blocks"
print(json.dumps(bench_plan.cuda_accuracy({name: bench_plan.CONFIGS[name]})))
"""


def test_plan_matches_max_memory_allocated():
    """The planned peak of the default GPT (fp32, a group per block) against
    torch.cuda.max_memory_allocated over two steps (benchmarks/bench_plan.py's
    measurement), in a fresh process so that no earlier test's workspaces or
    cached blocks count; the plan includes the cuBLAS workspaces
    ([Note: CUDA workspaces in the plan])."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29573"}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", _PLAN_VS_CUDA, str(root / "benchmarks")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.95 <= row["ratio"] <= 1.05, row


def test_torchao_float8_all_gather_on_cuda_matches_pytorch():
    """torchao's float8 training with float8 all-gathers on the GPU (float8
    matrix products on the tensor cores): the forward sees float8 weights,
    and outputs and gradients equal PyTorch's fully_shard's."""
    pytest.importorskip("torchao")
    from torch import nn
    from torch.distributed.fsdp import fully_shard as pt_fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from shardwise import fully_shard as sw_fully_shard

    runs = {}
    for name, fs in (("shardwise", sw_fully_shard), ("torch", pt_fully_shard)):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 128, bias=False))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        for m in (model[0], model[2], model):
            fs(m)
        seen = []
        model[0].register_forward_pre_hook(lambda mod, args: seen.append(type(mod.weight)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outs = []
        for step in range(3):
            x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            y = model(x)
            y.float().square().mean().backward()
            outs.append((y.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        runs[name] = (outs, seen)
    assert runs["shardwise"][1] == runs["torch"][1] == [Float8TrainingTensor] * 3
    for (y, g), (ry, rg) in zip(runs["shardwise"][0], runs["torch"][0]):
        torch.testing.assert_close(y, ry)
        for n in g:
            torch.testing.assert_close(g[n], rg[n], msg=n)
