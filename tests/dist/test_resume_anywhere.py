"""Resume anywhere: `shardwise train` stopped on 4 ranks (with background
checkpoints) and resumed on 2 and on 3 repeats the uninterrupted run's
losses; a checkpoint of the wrapper API loads into the per-module API and
back; `--resume` with an empty directory starts afresh (saying so), and with
a directory that holds anything but shardwise train's checkpoints is an
error naming the fix, before any rank starts.

The uninterrupted run is the command's training loop on the 4 ranks of the
test pool (``shardwise.train.loop.train``, as each spawned rank runs it, with
the configuration parsed from the same flags), and the run stopped at step 3
is also the one started with ``--resume`` in a directory that did not exist
yet: one launch of 4 ranks instead of three launches."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank, run_on_ranks

SRC = Path(__file__).resolve().parents[2] / "src"
# 12 sequences a step: they split over 2, 3 and 4 ranks alike
RUN = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16", "--batch-size", "12",
       "--steps", "6", "--warmup-steps", "2", "--lr", "1e-2"]


def _train(*args: str, timeout: float = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", *RUN, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _losses(path: Path) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _uninterrupted(metrics: str) -> None:
    """On every rank of the pool: `shardwise train` with RUN's flags, --nproc 4 and --metrics, as the
    command's spawned ranks run it (its loop, configuration and checks), without stopping."""
    import argparse

    from shardwise.train.config import add_flags, config_from_flags
    from shardwise.train.launch import World, preflight
    from shardwise.train.loop import train

    parser = argparse.ArgumentParser()
    add_flags(parser)
    cfg = config_from_flags(parser.parse_args([*RUN, "--nproc", "4", "--metrics", metrics]))
    train(preflight(cfg, World(4, False, local_size=4)), dist.get_rank(), torch.device("cpu"))
    dist.barrier()


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory):
    """An uninterrupted 4-rank run, and one stopped at step 3 with a background checkpoint (started with
    --resume in a directory that does not exist yet)."""
    tmp = tmp_path_factory.mktemp("anywhere")
    run_on_ranks(_uninterrupted, 4, metrics=str(tmp / "straight.jsonl"))
    out = _train("--nproc", "4", "--stop-at", "3", "--resume", "--checkpoint-dir", str(tmp / "ck"),
                 "--checkpoint-async", "--metrics", str(tmp / "stopped.jsonl"))
    (tmp / "stopped.out").write_text(out)
    assert "stopped at step 3" in out
    return tmp


@pytest.mark.parametrize("nproc", [2, 3])
def test_resume_on_another_number_of_ranks_repeats_the_losses(stopped_at_4, nproc):
    tmp = stopped_at_4
    ck = tmp / f"ck-{nproc}"
    shutil.copytree(tmp / "ck", ck)
    out = _train("--nproc", str(nproc), "--resume", "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
                 "--metrics", str(tmp / f"resumed-{nproc}.jsonl"))
    assert f"{nproc} ranks (gloo" in out and "step-00000003" in out
    straight = _losses(tmp / "straight.jsonl")
    resumed = {**_losses(tmp / "stopped.jsonl"), **_losses(tmp / f"resumed-{nproc}.jsonl")}
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    # The same sequences in every micro-batch, the same weights, AdamW state and learning rate: only the
    # summation order differs (the loss averaged over 2 or 3 partial means instead of 4, gradients
    # reduce-scattered over another number of ranks), about 1e-7 of the loss per step in fp32 and a few
    # AdamW steps to grow; the wrong data, optimizer state or step would move them by 1e-2 or more.
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-6), (step, resumed, straight)
    assert resumed[1] != resumed[4]  # it trained
    # its own checkpoint (saved on nproc ranks) keeps the data order of the 4 that started it
    extra = torch.load(ck / "step-00000006" / "extra.pt", weights_only=False)
    assert extra["data_world"] == 4 and extra["world_size"] == nproc and extra["step"] == 6


def test_resume_with_an_empty_directory_starts_afresh(stopped_at_4):
    tmp = stopped_at_4  # its stopped run was started with --resume and a directory that did not exist
    out = (tmp / "stopped.out").read_text()
    assert "--resume: no checkpoint in" in out and "starting from step 0" in out
    assert sorted(p.name for p in (tmp / "ck").iterdir()) == ["step-00000003"]
    # from step 0, as the uninterrupted run (4 ranks both: the same numbers)
    straight = _losses(tmp / "straight.jsonl")
    assert _losses(tmp / "stopped.jsonl") == {step: straight[step] for step in (1, 2, 3)}


def _preflight(tmp_path, checkpoint_dir, **changes):
    from shardwise.train.config import TrainConfig
    from shardwise.train.launch import World, preflight

    cfg = TrainConfig(dim=32, n_layers=2, n_heads=2, seq_len=16, batch_size=12, resume=True,
                      checkpoint_dir=str(checkpoint_dir), **changes)
    return preflight(cfg, World(2, False, local_size=2))


def test_resume_from_nothing_or_something_foreign(tmp_path, caplog):
    from shardwise.errors import CheckpointError

    caplog.set_level(logging.WARNING, logger="shardwise.train")
    # missing, empty, or only the leftovers of killed saves: a fresh start, said once
    for name, leftovers in (("missing", None), ("empty", []), ("killed", [".step-00000004.tmp-abc/__0_0.distcp",
                                                                             "step-00000004/.metadata"])):
        root = tmp_path / name
        for entry in leftovers if leftovers is not None else []:
            (root / entry).parent.mkdir(parents=True, exist_ok=True)
            (root / entry).write_bytes(b"x")
        if leftovers == []:
            root.mkdir()
        caplog.clear()
        assert _preflight(tmp_path, root).resume_from is None
        assert [r.getMessage() for r in caplog.records] == [
            f"--resume: no checkpoint in {str(root)!r} yet"
            + (" (what unfinished saves left there is ignored)" if leftovers else "") + "; starting from step 0"
        ]
    # somebody's files
    foreign = tmp_path / "foreign"
    (foreign / "photos").mkdir(parents=True)
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"holds no checkpoint of shardwise train but other files "
                                              r"\(notes.txt, photos\).*a new or empty directory"):
        _preflight(tmp_path, foreign)
    # another program's DCP checkpoint (no completion marker)
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"x")
    (dcp_dir / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="torch.distributed.checkpoint checkpoint that shardwise did not commit"):
        _preflight(tmp_path, dcp_dir)


@multi_rank(world_sizes=(2,))
def test_foreign_checkpoints_are_refused_before_ranks_start(tmp_path):
    """A checkpoint directory passed instead of its parent; a checkpoint of
    shardwise.checkpoint.save that is not a training run's; a batch that
    cannot take the same from each of the saved run's data slices."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import checkpoint
    from shardwise.errors import CheckpointError, ConfigError
    from shardwise.train.config import TrainConfig
    from shardwise.train.model import build_model, shard_model

    cfg = TrainConfig(dim=32, n_layers=2, n_heads=2, seq_len=16, vocab_size=256)
    built = build_model(cfg, 256, torch.device("cpu"))
    shard_model(built, cfg, init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)), torch.device("cpu"))
    model = built.model
    root = tmp_path / "lib"
    path = checkpoint.save(root, model, extra={"epoch": 1}, step=7)
    train_root = tmp_path / "train"
    checkpoint.save(train_root, model, extra={"step": 7, "data_position": 21, "data_world": 4, "world_size": 4},
                    step=7)
    dist.barrier()
    if dist.get_rank() != 0:
        return
    with pytest.raises(CheckpointError, match="is one checkpoint, not the directory.*--checkpoint-dir"):
        _preflight(tmp_path, path)
    with pytest.raises(CheckpointError, match="was not written by shardwise train"):
        _preflight(tmp_path, root)
    assert _preflight(tmp_path, train_root).resume_from == train_root / "step-00000007"
    with pytest.raises(ConfigError, match=r"the run that started this training had 4 ranks.*grad_accum in \{1, 3\}"):
        _preflight(tmp_path, train_root, grad_accum=2)


# ---- the wrapper API's checkpoints in the per-module API and back ---------------------
def _gpt_cfg():
    from shardwise.models import GPTConfig

    return GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)


def _wrapper(seed, strategy="FULL_SHARD"):
    from shardwise import FullyShardedDataParallel, ShardingStrategy
    from shardwise.models import GPT, Block
    from shardwise.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    return FullyShardedDataParallel(GPT(_gpt_cfg()), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    sharding_strategy=getattr(ShardingStrategy, strategy))


def _per_module(seed):
    from shardwise import apply_policy
    from shardwise.models import GPT, Block
    from shardwise.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    return apply_policy(GPT(_gpt_cfg()), ModuleWrapPolicy({Block}))


def _step(model, opt, seed):
    from shardwise.models import GPT, synthetic_batch

    x, y = synthetic_batch(_gpt_cfg(), 3, seed=seed, rank=dist.get_rank())
    loss = GPT.loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full_state(model, opt):
    """Whole parameters and optimizer state by original name, the same on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map_only

    full = StateDictOptions(full_state_dict=True)
    state = {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, opt, options=full)}
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)


def _assert_same(a, b, where):
    assert sorted(a["model"]) == sorted(b["model"]), where
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{where}: {k}"
    assert sorted(a["optim"]["state"]) == sorted(b["optim"]["state"]), where
    for k, state in a["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optim"]["state"][k][name]), f"{where}: {k}.{name}"
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"], where


@pytest.mark.parametrize("strategy,async_mode", [("FULL_SHARD", False), ("FULL_SHARD", True),
                                                 ("SHARD_GRAD_OP", True), ("NO_SHARD", False)])
@multi_rank(world_sizes=(2,))
def test_wrapper_checkpoint_loads_into_fully_shard_and_back(tmp_path, strategy, async_mode):
    from torch.distributed.checkpoint import FileSystemReader

    from shardwise import FullyShardedDataParallel, StateDictType, checkpoint

    def save(name, model, opt, step):
        saved = checkpoint.save(tmp_path / name, model, opt, extra={"step": step}, async_mode=async_mode)
        return saved.wait() if async_mode else saved

    wrapper = _wrapper(0, strategy)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(2):
        _step(wrapper, opt, s)
    path = save("from-wrapper", wrapper, opt, 2)
    want = _full_state(wrapper, opt)
    # sharded like fully_shard's: each rank wrote only its shard (not a gathered FULL_STATE_DICT, the
    # wrapper's default, which is back in force)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert len(metadata["model.blocks.0.qkv.weight"].chunks) == (1 if strategy == "NO_SHARD" else 2)
    assert FullyShardedDataParallel.get_state_dict_type(wrapper).state_dict_type == StateDictType.FULL_STATE_DICT

    per_module = _per_module(5)
    per_module_opt = torch.optim.AdamW(per_module.parameters(), lr=0.5)  # hyper-parameters come from the checkpoint
    assert checkpoint.load(path, per_module, per_module_opt) == {"step": 2}
    _assert_same(_full_state(per_module, per_module_opt), want, "wrapper -> fully_shard")
    # both go on alike (the same weights, Adam moments and step count)
    assert _step(per_module, per_module_opt, 2) == _step(wrapper, opt, 2)
    _assert_same(_full_state(per_module, per_module_opt), _full_state(wrapper, opt), "after a step")

    path = save("from-fully-shard", per_module, per_module_opt, 3)
    want = _full_state(per_module, per_module_opt)
    back = _wrapper(9, strategy)
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.5)
    assert checkpoint.load(path, back, back_opt) == {"step": 3}
    _assert_same(_full_state(back, back_opt), want, "fully_shard -> wrapper")
    assert _step(back, back_opt, 3) == _step(per_module, per_module_opt, 3)
