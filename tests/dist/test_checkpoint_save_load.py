"""shardwise.checkpoint.save / load / latest: round trips, resharding across
world sizes (model, optimizer, extra, and the losses of continued training),
interoperability with plain torch.distributed.checkpoint, and bad input."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank, run_on_ranks

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
SAVE_AT = 3
TOTAL = 5


def _cfg(n_layers=2, dim=20, tie=True):
    from shardwise.models import GPTConfig

    # 61 / 12 / 20 / 60 rows: uneven shards on 3 and 4 ranks
    return GPTConfig(vocab_size=61, seq_len=12, dim=dim, n_layers=n_layers, n_heads=2, mlp_ratio=3, tie_embeddings=tie)


def _model(cfg, mesh=None, precision="fp32"):
    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    mp = MixedPrecisionPolicy()
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _optim(model, lr=1e-2):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _step(model, opt, cfg, step):
    """One step on this rank's slice of the global batch; returns the global loss."""
    from shardwise.models import GPT, synthetic_batch

    x, y = synthetic_batch(cfg, GLOBAL_BATCH, seed=step)
    n = GLOBAL_BATCH // dist.get_world_size()
    r = dist.get_rank()
    loss = GPT.loss(model(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _full_state(model, opt):
    """Whole model and optimizer state (identical on every rank), cloned: the
    helpers return live tensors where nothing needs gathering (Adam's step)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map_only

    full = StateDictOptions(full_state_dict=True)
    state = {"model": get_model_state_dict(model, options=full)}
    if opt is not None:
        state["optim"] = get_optimizer_state_dict(model, opt, options=full)
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)


def _assert_equal(a, b, where=""):
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), f"{where}: {list(a)} != {list(b)}"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: values differ (max {(a.float() - b.float()).abs().max()})"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _extra(step):
    return {
        "step": step,
        "rng": torch.get_rng_state(),
        "data": {"epoch": 1, "position": 1234 + step},
        "per_rank": [f"rank{r}" for r in range(dist.get_world_size())],
    }


# ---- resharding: save at 4 ranks, load at 1, 2, 3, and back ---------------------------
def _train_and_save(root, ref_file):
    """Train TOTAL steps, saving at SAVE_AT; rank 0 records the saved state and
    the losses of the uninterrupted run."""
    from shardwise import checkpoint

    cfg = _cfg()
    model = _model(cfg)
    opt = _optim(model)
    losses = []
    saved = None
    for step in range(TOTAL):
        losses.append(_step(model, opt, cfg, step))
        if step + 1 == SAVE_AT:
            torch.manual_seed(1234)
            checkpoint.save(root, model, opt, extra=_extra(SAVE_AT), step=SAVE_AT)
            saved = _full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save({"state": saved, "losses": losses, "extra": _extra(SAVE_AT)}, ref_file)


def _load_and_continue(path, ref_file, resave_to=None):
    from shardwise import checkpoint

    ref = torch.load(ref_file, weights_only=False)
    cfg = _cfg()
    model = _model(cfg)
    opt = _optim(model, lr=0.5)  # the checkpoint's hyper-parameters replace these
    extra = checkpoint.load(path, model, opt)
    _assert_equal(_full_state(model, opt), ref["state"], "state")
    assert extra["step"] == SAVE_AT and extra["data"] == ref["extra"]["data"]
    assert torch.equal(extra["rng"], ref["extra"]["rng"]) and extra["per_rank"] == ref["extra"]["per_rank"]
    if resave_to is not None:
        checkpoint.save(resave_to, model, opt, extra=extra)
    return [_step(model, opt, cfg, step) for step in range(extra["step"], TOTAL)]


def test_reshard_save_4_load_1_2_3_and_back(tmp_path):
    root, ref_file = str(tmp_path / "run"), str(tmp_path / "ref.pt")
    run_on_ranks(_train_and_save, 4, root=root, ref_file=ref_file)
    from shardwise.checkpoint import latest

    path = latest(root)
    assert path is not None and path.name == f"step-{SAVE_AT:08d}"
    expected = torch.load(ref_file, weights_only=False)["losses"][SAVE_AT:]
    for ws in (4, 1, 2, 3):
        resave = str(tmp_path / f"resaved-{ws}") if ws == 3 else None
        losses = run_on_ranks(_load_and_continue, ws, path=str(path), ref_file=ref_file, resave_to=resave)[0]
        if ws == 4:
            assert losses == expected  # same world size: bit for bit
        else:
            # another reduction order inside the collectives only
            torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6, msg=f"world size {ws}")
    # and back: saved at 3 ranks (uneven shards), loaded at 4
    losses = run_on_ranks(_load_and_continue, 4, path=str(tmp_path / "resaved-3"), ref_file=ref_file)[0]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


# ---- round trips ------------------------------------------------------------------------
@pytest.mark.parametrize("tie,precision", [(True, "bf16"), (False, "fp32")])
@multi_rank(world_sizes=(2,))
def test_round_trip_into_fresh_model(tmp_path, tie, precision):
    from shardwise import checkpoint

    cfg = _cfg(tie=tie)
    model = _model(cfg, precision=precision)
    opt = _optim(model)
    for step in range(2):
        _step(model, opt, cfg, step)
    root = str(tmp_path)  # the same directory on every rank (shared file system)
    path = checkpoint.save(root, model, opt, extra={"step": 2, "t": torch.arange(3)}, step=2)
    assert path == Path(root).resolve() / "step-00000002" and checkpoint.latest(root) == path
    fresh = _model(cfg, precision=precision)
    fresh_opt = _optim(fresh)
    extra = checkpoint.load(path, fresh, fresh_opt)
    assert extra["step"] == 2 and torch.equal(extra["t"], torch.arange(3))
    _assert_equal(_full_state(fresh, fresh_opt), _full_state(model, opt))
    assert fresh.lm_head.weight is fresh.tok_emb.weight if tie else True
    # both continue identically
    assert _step(model, opt, cfg, 2) == _step(fresh, fresh_opt, cfg, 2)
    # without optimizer and extra
    path = checkpoint.save(os.path.join(root, "model-only"), model)
    other = _model(cfg, precision=precision)
    assert checkpoint.load(path, other) is None
    _assert_equal(_full_state(other, None), _full_state(model, None))


@multi_rank(world_sizes=(2,))
def test_optimizer_that_never_stepped(tmp_path):
    """Saving leaves an optimizer without state untouched (PyTorch's helper would
    initialise it with a step); loading such a checkpoint gives an optimizer
    without state, and training goes on exactly as from the original."""
    from shardwise import checkpoint

    cfg = _cfg()
    model = _model(cfg)
    opt = _optim(model)
    path = checkpoint.save(str(tmp_path / "ck"), model, opt)
    assert len(opt.state) == 0
    fresh = _model(cfg)
    fresh_opt = _optim(fresh, lr=0.5)
    checkpoint.load(path, fresh, fresh_opt)
    assert len(fresh_opt.state) == 0 and fresh_opt.param_groups[0]["lr"] == 1e-2
    assert [_step(fresh, fresh_opt, cfg, s) for s in range(2)] == [_step(model, opt, cfg, s) for s in range(2)]


@multi_rank(world_sizes=(4,))
def test_hsdp_checkpoint_loads_on_a_1d_mesh(tmp_path):
    """Saved on a 2 x 2 (replicate, shard) mesh; loaded with 4-way sharding."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import checkpoint

    cfg = _cfg()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(cfg, mesh=mesh)
    opt = _optim(model)
    _step(model, opt, cfg, 0)
    path = checkpoint.save(str(tmp_path / "hsdp"), model, opt)
    flat = _model(cfg)
    flat_opt = _optim(flat)
    checkpoint.load(path, flat, flat_opt)
    _assert_equal(_full_state(flat, flat_opt), _full_state(model, opt))
    assert _step(flat, flat_opt, cfg, 1) == pytest.approx(_step(model, opt, cfg, 1), rel=1e-6)


@multi_rank(world_sizes=(2,))
def test_latest_overwrite_and_keep(tmp_path):
    from shardwise import checkpoint
    from shardwise.checkpoint import CheckpointError

    cfg = _cfg(n_layers=1)
    model = _model(cfg)
    root = str(tmp_path)
    assert checkpoint.latest(root) is None
    for step in (5, 40, 300):
        checkpoint.save(root, model, step=step, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(root)] == [40, 300]
    assert checkpoint.latest(root).name == "step-00000300"
    with pytest.raises(CheckpointError, match="already exists.*overwrite=True"):
        checkpoint.save(root, model, step=300)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpoint.save(root, model, step=300, overwrite=True)
    other = _model(cfg)
    checkpoint.load(checkpoint.latest(root), other)
    _assert_equal(_full_state(other, None), _full_state(model, None))
    dist.barrier()
    assert sorted(os.listdir(root)) == ["step-00000040", "step-00000300"]  # nothing left behind


@multi_rank(world_sizes=(2,))
def test_latest_is_the_last_committed_under_any_name(tmp_path):
    """``latest(root)`` counts a committed checkpoint whatever its name
    (``root/best`` too) and returns the one committed last, by the sequence
    its marker records: not by name, step or modification time. Saves that
    never completed, hidden staging / ``.old-`` directories and foreign
    directories never count. Markers written before the sequence existed
    still load and order by their commit time, before any newer one."""
    import json
    import shutil
    import time

    from shardwise import checkpoint

    cfg = _cfg(n_layers=1)
    model = _model(cfg)
    root = Path(tmp_path) / "run"
    assert checkpoint.latest(root) is None
    states = {}

    def save(name, **kwargs):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # every checkpoint holds other values
        path = checkpoint.save(root / name if name else root, model, **kwargs)
        states[path.name] = _full_state(model, None)
        return path

    def check(expected):
        found = checkpoint.latest(root)
        assert found == root.resolve() / expected, found
        other = _model(cfg)
        checkpoint.load(found, other)
        _assert_equal(_full_state(other, None), states[expected], expected)

    save(None, step=5)
    check("step-00000005")
    save("best")  # sorts before step-*, has no step
    check("best")
    save(None, step=3)  # a lower step, committed later (a rewound run)
    check("step-00000003")
    save("best", overwrite=True)
    check("best")
    assert [s for s, _ in checkpoint.list_checkpoints(root)] == [3, 5]  # keep= still sees step-N only

    if dist.get_rank() == 0:
        # modification times do not decide: make the others look newer
        future = time.time() + 3600
        for name in ("step-00000005", "step-00000003"):
            os.utime(root / name, (future, future))
            os.utime(root / name / "complete.json", (future, future))
        # none of these count
        (root / "zz-partial").mkdir()  # a save killed before its marker
        (root / "zz-partial" / "__0_0.distcp").write_bytes(b"x")
        (root / "zz-notes").mkdir()  # somebody's directory
        (root / "zz-notes" / "README").write_text("not a checkpoint")
        (root / "zz-foreign").mkdir()
        (root / "zz-foreign" / "complete.json").write_text('{"format": "other", "sequence": 99}')
        for hidden in (".best.old-abc", ".step-00000009.tmp-def"):  # complete copies, but hidden
            shutil.copytree(root / "best", root / hidden)
            marker = json.loads((root / hidden / "complete.json").read_text())
            marker["sequence"] = 99
            (root / hidden / "complete.json").write_text(json.dumps(marker))
    dist.barrier()
    check("best")

    # markers written before the sequence existed: ordered by their commit time
    legacy = Path(tmp_path) / "legacy"
    if dist.get_rank() == 0:
        for name, created in (("step-00000005", 2000.0), ("step-00000003", 1000.0)):
            shutil.copytree(root / name, legacy / name)
            marker = json.loads((legacy / name / "complete.json").read_text())
            del marker["sequence"]
            marker["created"] = created
            (legacy / name / "complete.json").write_text(json.dumps(marker))
    dist.barrier()
    assert checkpoint.latest(legacy) == legacy.resolve() / "step-00000005"
    root = legacy
    check("step-00000005")
    save(None, step=1)  # the first sequenced commit is newer than every legacy one
    check("step-00000001")
    dist.barrier()


@multi_rank(world_sizes=(2,))
def test_plain_dcp_reads_our_checkpoint_into_torch_fully_shard(tmp_path):
    """A shardwise checkpoint is an ordinary DCP checkpoint (torchtitan layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import checkpoint
    from shardwise.models import GPT

    cfg = _cfg()
    model = _model(cfg)
    opt = _optim(model)
    _step(model, opt, cfg, 0)
    path = checkpoint.save(str(tmp_path / "ck"), model, opt)
    torch.manual_seed(0)
    theirs = GPT(cfg)
    for block in theirs.blocks:
        torch_fully_shard(block)
    torch_fully_shard(theirs)
    topt = _optim(theirs, lr=0.3)
    state = {"model": get_model_state_dict(theirs), "optim": get_optimizer_state_dict(theirs, topt)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(theirs, state["model"])
    set_optimizer_state_dict(theirs, topt, state["optim"])
    _assert_equal(_full_state(theirs, topt), _full_state(model, opt))


# ---- failures while saving ------------------------------------------------------------
def _fail_at(mp, stage):
    """Make the next save fail at ``stage`` (on one rank only where possible)."""
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint import commit

    def boom(*args, **kwargs):
        raise OSError(f"injected failure at {stage}")

    if stage == "write" and dist.get_rank() == 1:
        mp.setattr(dcp.FileSystemWriter, "write_data", boom)
    elif stage == "metadata":
        mp.setattr(dcp.FileSystemWriter, "finish", boom)
    elif stage == "marker" and dist.get_rank() == 0:
        mp.setattr(commit, "write_marker", boom)


@pytest.mark.parametrize("stage", ["write", "metadata", "marker"])
@multi_rank(world_sizes=(2,))
def test_failed_save_keeps_previous_checkpoint(tmp_path, stage):
    from shardwise import checkpoint

    cfg = _cfg(n_layers=1)
    model = _model(cfg)
    opt = _optim(model)
    _step(model, opt, cfg, 0)
    root = str(tmp_path)
    good = checkpoint.save(root, model, opt, extra={"step": 1}, step=1)
    saved = _full_state(model, opt)
    _step(model, opt, cfg, 1)
    with pytest.MonkeyPatch.context() as mp:
        _fail_at(mp, stage)
        with pytest.raises(Exception, match="injected failure") as info:
            checkpoint.save(root, model, opt, extra={"step": 2}, step=2)
    assert info.type is not AssertionError
    dist.barrier()
    assert checkpoint.latest(root) == good
    assert [s for s, _ in checkpoint.list_checkpoints(root)] == [1]
    # the staging directory is cleaned up (a failed marker renames it back first)
    assert sorted(os.listdir(root)) == ["step-00000001"]
    fresh = _model(cfg)
    fresh_opt = _optim(fresh)
    assert checkpoint.load(checkpoint.latest(root), fresh, fresh_opt) == {"step": 1}
    _assert_equal(_full_state(fresh, fresh_opt), saved)
    # the next save to the same step goes through and replaces the leftover
    dist.barrier()
    assert checkpoint.save(root, model, opt, step=2) == checkpoint.latest(root)


# ---- bad input: nothing in memory changes -------------------------------------------
def _snapshot(model, opt):
    """Local shards and optimizer state, cloned (no communication)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    params = {k: local(v) for k, v in model.state_dict().items()}
    state = {
        id(p): {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for p, s in opt.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def _check_rejected(path, model, opt, match):
    from shardwise import checkpoint

    before = _snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.load(path, model, opt)
    _assert_equal(_snapshot(model, opt), before, "after a rejected load")


@multi_rank(world_sizes=(2,))
def test_checkpoint_of_another_model_is_rejected(tmp_path):
    from shardwise import checkpoint

    cfg = _cfg()
    model = _model(cfg)
    opt = _optim(model)
    _step(model, opt, cfg, 0)
    path = checkpoint.save(str(tmp_path / "ck"), model, opt)
    _step(model, opt, cfg, 1)
    deeper = _model(_cfg(n_layers=3))
    deeper_opt = _optim(deeper)
    _step(deeper, deeper_opt, _cfg(n_layers=3), 0)
    _check_rejected(path, deeper, deeper_opt, r"missing from the checkpoint: 'blocks\.2\.")
    shallower = _model(_cfg(n_layers=1))
    _check_rejected(path, shallower, _optim(shallower), r"in the checkpoint but not in the model: 'blocks\.1\.")
    wider = _model(_cfg(dim=24))
    _check_rejected(path, wider, _optim(wider), r"'tok_emb\.weight' has shape \[61, 20\] in the checkpoint but \[61, 24\]")
    # an optimizer over other parameter groups
    in_blocks = {id(p) for p in model.blocks.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_blocks]
    two_groups = torch.optim.AdamW([{"params": list(model.blocks.parameters())}, {"params": rest}], lr=1e-3)
    _step(model, two_groups, cfg, 2)
    _check_rejected(path, model, two_groups, r"1 parameter group\(s\), this one 2")
    partial = torch.optim.AdamW(model.blocks.parameters(), lr=1e-3)
    _step(model, partial, cfg, 3)
    _check_rejected(path, model, partial, "state for parameters this optimizer does not hold: .*'norm.bias'")
    # a model-only checkpoint cannot fill an optimizer
    model_only = checkpoint.save(str(tmp_path / "model-only"), model)
    _check_rejected(model_only, model, opt, "holds no optimizer state")


def _damage(path, how):
    files = sorted(p for p in Path(path).iterdir() if p.name.endswith(".distcp"))
    if how == "truncated":
        data = files[-1].read_bytes()
        files[-1].write_bytes(data[: len(data) // 2])
    elif how == "corrupted":
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        files[0].write_bytes(bytes(data))
    elif how == "metadata":
        meta = Path(path) / ".metadata"
        meta.write_bytes(meta.read_bytes()[::-1])
    elif how == "no_marker":
        (Path(path) / "complete.json").unlink()
    elif how == "bad_marker":
        (Path(path) / "complete.json").write_text("{not json")
    elif how == "missing_file":
        files[0].unlink()


@pytest.mark.parametrize(
    "how,match",
    [
        ("truncated", r"__1_0\.distcp has \d+ bytes, \d+ were written \(truncated\)"),
        ("corrupted", r"__0_0\.distcp is corrupted"),
        ("metadata", r"\.metadata is corrupted"),
        ("no_marker", "not a complete checkpoint: it has no complete.json"),
        ("bad_marker", "complete.json' is corrupted"),
        ("missing_file", r"__0_0\.distcp is missing"),
    ],
)
@multi_rank(world_sizes=(2,))
def test_damaged_checkpoint_is_rejected(tmp_path, how, match):
    from shardwise import checkpoint

    cfg = _cfg(n_layers=1)
    model = _model(cfg)
    opt = _optim(model)
    _step(model, opt, cfg, 0)
    path = checkpoint.save(str(tmp_path / "ck"), model, opt)
    if dist.get_rank() == 0:
        _damage(path, how)
    dist.barrier()
    _step(model, opt, cfg, 1)
    _check_rejected(path, model, opt, match)


@multi_rank(world_sizes=(2,))
def test_not_a_checkpoint_is_rejected(tmp_path):
    from shardwise import checkpoint

    cfg = _cfg(n_layers=1)
    model = _model(cfg)
    opt = _optim(model)
    _step(model, opt, cfg, 0)
    root = tmp_path / "root"
    checkpoint.save(str(root), model, step=7)
    (tmp_path / "file.bin").write_bytes(b"hello")
    (tmp_path / "empty").mkdir(exist_ok=True)
    dist.barrier()
    _check_rejected(tmp_path / "nope", model, opt, "does not exist")
    _check_rejected(tmp_path / "file.bin", model, opt, "is a file, not a checkpoint directory")
    _check_rejected(tmp_path / "empty", model, opt, "no complete.json")
    _check_rejected(root, model, opt, r"holds checkpoints: pass one of them, e\.g\. shardwise\.checkpoint\.latest")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        checkpoint.load(root / "step-00000007", "model")
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        checkpoint.save(str(root), model, step=-1)
