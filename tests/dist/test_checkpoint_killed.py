"""A process SIGKILLed in the middle of ``checkpoint.save`` leaves the previous
checkpoint intact and nothing that ``load`` or ``latest`` would accept.

Each case runs a one-rank training process that saves step 1, then dies
during the save of step 2: at fixed points of the commit protocol (after the
shards are written but before the metadata, after everything is written but
before the rename, after the rename but before the completion marker), and
once at a random moment of a stream of saves. The survivors are then loaded
on two ranks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise.testing import run_on_ranks

SRC = Path(__file__).resolve().parents[2] / "src"

TRAINER = r"""
import os, signal, sys
import torch, torch.distributed as dist
root, stage, store = sys.argv[1:4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
import torch.distributed.checkpoint as dcp
from shardwise import checkpoint, fully_shard
from shardwise.checkpoint import commit
from shardwise.models import GPT, GPTConfig, synthetic_batch

torch.manual_seed(0)
cfg = GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)
model = GPT(cfg)
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

def train(step):
    x, y = synthetic_batch(cfg, 4, seed=step)
    GPT.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()

def full():
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

train(0)
checkpoint.save(root, model, opt, extra={"step": 1}, step=1)
torch.save(full(), os.path.join(root, "..", f"ref-{stage}-1.pt"))
print("saved 1", flush=True)

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if stage == "data":        # shards written and fsync-ed, no metadata yet
    dcp.FileSystemWriter.finish = die
elif stage == "commit":    # everything written and checksummed, not yet renamed
    commit.commit = die
elif stage == "marker":    # renamed to step-00000002, completion marker not yet written
    commit.write_marker = die
step = 1
while True:
    train(step)
    step += 1
    torch.save(full(), os.path.join(root, "..", f"ref-{stage}-{step}.pt"))
    checkpoint.save(root, model, opt, extra={"step": step}, step=step)
    print(f"saved {step}", flush=True)
"""


def _start(tmp_path, stage):
    root = tmp_path / stage / "ckpt"
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    store = tmp_path / stage / "store"
    with open(tmp_path / stage / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(root), stage, str(store)],
            stdout=subprocess.PIPE if stage == "random" else subprocess.DEVNULL,
            stderr=err,
            text=True,
            env=env,
        )
    return root, proc


def _verify(root, stage, expect_latest):
    """On every rank: the newest committed checkpoint loads and holds what was
    saved; leftovers of the killed save are refused."""
    from shardwise import checkpoint, fully_shard
    from shardwise.models import GPT, GPTConfig

    root = Path(root)
    latest = checkpoint.latest(root)
    assert latest is not None
    if expect_latest is not None:
        assert latest.name == f"step-{expect_latest:08d}", latest
    step = int(latest.name.split("-")[1])
    for other in root.iterdir():
        if other != latest and not (other / "complete.json").exists():
            with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
                checkpoint.load(other, GPT(GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)))
    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert checkpoint.load(latest, model, opt) == {"step": step}
    ref = torch.load(root.parent / f"ref-{stage}-{step}.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), ref[k]), k
    return sorted(p.name for p in root.iterdir())


def test_sigkill_during_save(tmp_path):
    stages = ["data", "commit", "marker", "random"]
    procs = {stage: _start(tmp_path, stage) for stage in stages}
    # the random case: kill at a random moment once a few saves went through
    root, proc = procs["random"]
    for line in proc.stdout:
        if line.startswith("saved 3"):
            break
    time.sleep(random.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    for stage, (root, proc) in procs.items():
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{stage}: the training process did not die")
        stderr = (tmp_path / stage / "stderr.txt").read_text()
        assert proc.returncode == -signal.SIGKILL, f"{stage}: exit {proc.returncode}\n{stderr}"
    for stage in ["data", "commit", "marker"]:
        root, _ = procs[stage]
        names = run_on_ranks(_verify, 2, root=str(root), stage=stage, expect_latest=1)[0]
        # step 1 intact; step 2 only as an uncommitted leftover
        leftover = [n for n in names if n != "step-00000001"]
        assert "step-00000001" in names and len(leftover) == 1, names
        if stage == "marker":
            assert leftover[0] == "step-00000002"
        else:
            assert leftover[0].startswith(".step-00000002.tmp-")
    root, _ = procs["random"]
    run_on_ranks(_verify, 2, root=str(root), stage="random", expect_latest=None)
