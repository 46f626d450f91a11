"""shardwise.checkpoint.export / load_from_file: one unsharded safetensors file
that a plain model loads, gathered one group at a time; and back, each rank
reading only its own shards. Files are checked with the official library."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank


def _cfg(tie=True, dim=20):
    from shardwise.models import GPTConfig

    return GPTConfig(vocab_size=61, seq_len=12, dim=dim, n_layers=2, n_heads=2, mlp_ratio=3, tie_embeddings=tie)


def _plain(cfg, seed=0):
    from shardwise.models import GPT

    torch.manual_seed(seed)
    model = GPT(cfg)
    model.register_buffer("scale", torch.linspace(0.5, 1.5, cfg.dim))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in state dicts
    return model


def _shard(model, precision="fp32", mesh=None, placement=None):
    from shardwise import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mp_policy=mp, mesh=mesh, shard_placement_fn=placement)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _train(model, cfg, steps=2):
    from shardwise.models import GPT, synthetic_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
        GPT.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # leaves the root unsharded (bf16 under mixed precision)
        model(x)


def _full(model):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _placement(kind):
    from torch.distributed.tensor import Shard

    if kind == "dim1":
        return lambda p: Shard(1) if p.ndim == 2 else None
    return None


@pytest.mark.parametrize("tie,precision,layout", [(True, "bf16", "dim0"), (False, "fp32", "dim1"), (True, "fp32", "hsdp")])
@multi_rank(world_sizes=(2, 3))
def test_export_loads_into_plain_model(tmp_path, world_size, tie, precision, layout):
    import safetensors
    import safetensors.torch
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise.checkpoint.single_file as export_mod
    from shardwise._engine.module_state import states_under
    from shardwise.checkpoint import export

    cfg = _cfg(tie, dim=24 if layout == "dim1" else 20)  # Shard(1) must divide evenly (as PyTorch)
    mesh = None
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard(_plain(cfg), precision, mesh, _placement(layout))
    _train(model, cfg)
    expected = _full(model)  # full precision whatever the policy
    plain = _plain(cfg, seed=5)
    assert list(expected) == list(plain.state_dict())

    # no rank ever holds more than one group's full parameters
    groups = [s.group for s in states_under(model) if s.group is not None]
    real = export_mod.summon_full_params
    seen = []

    def unsharded_bytes(group):  # a buffer they share counted once
        storages = {}
        for p in group.params:
            if p.unsharded_param is not None:
                storage = p.unsharded_param.untyped_storage()
                storages[storage.data_ptr() or id(p)] = storage.size()
        return sum(storages.values())

    def watched(module, recurse=True, writeback=True):
        busy = [g for g in groups if unsharded_bytes(g) and g.is_unsharded]
        assert not busy, f"{[g.name for g in busy]} still unsharded when the next group is gathered"
        seen.append(module)
        return real(module, recurse=recurse, writeback=writeback)

    path = tmp_path / "model.safetensors"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_mod, "summon_full_params", watched)
        assert export(str(path), model, metadata={"step": "2"}) == path
    assert len(seen) == len(groups)
    assert not any(g.is_unsharded for g in groups)
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left
    if dist.get_rank() == 0:
        loaded = safetensors.torch.load_file(str(path))
        assert sorted(loaded) == sorted(expected)
        for k, v in expected.items():
            assert loaded[k].dtype == torch.float32 and torch.equal(loaded[k], v), k
        plain.load_state_dict(loaded, strict=True)
        for k, v in plain.state_dict().items():
            assert torch.equal(v, expected[k]), k
        with safetensors.safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt", "step": "2"}
        # byte level: 8-byte little-endian length, JSON, data 8-byte aligned and contiguous
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        assert (8 + n) % 8 == 0
        spans = sorted(tuple(e["data_offsets"]) for k, e in header.items() if k != "__metadata__")
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] == len(raw) - 8 - n
        weight = header["blocks.0.qkv.weight"]
        start = 8 + n + weight["data_offsets"][0]
        want = expected["blocks.0.qkv.weight"].numpy().astype("<f4").tobytes()
        assert raw[start : start + len(want)] == want


def _count_reads(mp):
    import shardwise.checkpoint.safetensors_format as st

    counted = {"bytes": 0}
    real = st._readinto_tensor

    def counting(f, out, what):
        counted["bytes"] += out.numel() * out.element_size()
        return real(f, out, what)

    mp.setattr(st, "_readinto_tensor", counting)
    return counted


@pytest.mark.parametrize("layout", ["dim0", "dim1", "hsdp"])
@multi_rank(world_sizes=(3,))
def test_load_from_file_reads_only_own_shards(tmp_path, world_size, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardwise.checkpoint import export, load_from_file

    cfg = _cfg(tie=True, dim=24 if layout == "dim1" else 20)  # Shard(1) must divide evenly
    source = _shard(_plain(cfg, seed=1))
    path = tmp_path / "model.safetensors"
    export(str(path), source)
    expected = _full(source)
    mesh = None
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    model = _shard(_plain(cfg, seed=2), "bf16", mesh, _placement(layout))
    with pytest.MonkeyPatch.context() as mp:
        counted = _count_reads(mp)
        load_from_file(str(path), model)
    local = {}
    for k, v in model.state_dict(keep_vars=True).items():  # both tied names are read and compared
        local[k] = (v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size()
    assert counted["bytes"] == sum(local.values())
    assert counted["bytes"] < 0.6 * path.stat().st_size  # about a third, plus the replicated buffer
    got = _full(model)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert model.lm_head.weight is model.tok_emb.weight


@multi_rank(world_sizes=(2,))
def test_load_from_files_written_by_the_official_library(tmp_path):
    import safetensors.torch

    from shardwise.checkpoint import load_from_file

    cfg = _cfg(tie=True)
    ref = _plain(cfg, seed=3)
    if dist.get_rank() == 0:
        # save_model keeps one name per tied weight; save_file needs distinct tensors
        safetensors.torch.save_model(ref, str(tmp_path / "deduped.safetensors"))
        sd = {k: v.clone() for k, v in ref.state_dict().items()}
        safetensors.torch.save_file(sd, str(tmp_path / "full.safetensors"))
    dist.barrier()
    for name in ("deduped", "full"):
        model = _shard(_plain(cfg, seed=4))
        load_from_file(str(tmp_path / f"{name}.safetensors"), model)
        got = _full(model)
        for k, v in ref.state_dict().items():
            assert torch.equal(got[k], v), (name, k)
    # names the model lacks: refused, unless strict=False
    if dist.get_rank() == 0:
        sd["step_count"] = torch.tensor([3])
        safetensors.torch.save_file(sd, str(tmp_path / "more.safetensors"))
    dist.barrier()
    model = _shard(_plain(cfg, seed=4))
    with pytest.raises(ValueError, match="in the file but not in the model: 'step_count'"):
        load_from_file(str(tmp_path / "more.safetensors"), model)
    load_from_file(str(tmp_path / "more.safetensors"), model, strict=False)
    assert torch.equal(_full(model)["blocks.1.qkv.weight"], ref.state_dict()["blocks.1.qkv.weight"])


def _snapshot(model):
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}


@multi_rank(world_sizes=(2,))
def test_bad_files_are_rejected(tmp_path):
    from shardwise.checkpoint import CheckpointError, export, load_from_file

    cfg = _cfg()
    model = _shard(_plain(cfg))
    good = tmp_path / "good.safetensors"
    export(str(good), model)
    other = _shard(_plain(_cfg(dim=24)))
    export(str(tmp_path / "wider.safetensors"), other)
    untied = _shard(_plain(_cfg(tie=False)))
    export(str(tmp_path / "untied.safetensors"), untied)
    if dist.get_rank() == 0:
        raw = good.read_bytes()
        (tmp_path / "truncated.safetensors").write_bytes(raw[:-100])
        (n,) = struct.unpack("<Q", raw[:8])
        (tmp_path / "garbled.safetensors").write_bytes(raw[:8] + b"#" * n + raw[8 + n :])
        (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 2**40) + raw[8:])
        header = json.loads(raw[8 : 8 + n])
        del header["pos_emb.weight"]
        text = json.dumps(header).encode()
        (tmp_path / "hole.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
        (tmp_path / "dir.safetensors").mkdir()
    dist.barrier()
    target = _shard(_plain(cfg, seed=9))
    before = _snapshot(target)
    cases = {
        "truncated": "header describes .* bytes of data but the file holds .* truncated",
        "garbled": "the header is not JSON",
        "huge": "header length says 1099511627776 bytes",
        "hole": "tensor data is not contiguous",
        "wider": r"'tok_emb\.weight' has shape \[61, 24\] in the file but \[61, 20\]",
        "untied": "'tok_emb.weight' and 'lm_head.weight' are one tied tensor in the model but differ in the file",
        "dir": "is a directory",
        "missing": "does not exist",
    }
    for name, match in cases.items():
        with pytest.raises(CheckpointError, match=match):
            load_from_file(str(tmp_path / f"{name}.safetensors"), target)
            pytest.fail(f"{name}: not rejected")
        after = _snapshot(target)
        for k, v in before.items():
            assert torch.equal(after[k], v), (name, k)
    # a file that lacks one of the model's keys: exported tied, loaded untied
    untied_target = _shard(_plain(_cfg(tie=False)))
    before = _snapshot(untied_target)
    if dist.get_rank() == 0:
        import safetensors.torch

        safetensors.torch.save_model(_plain(cfg), str(tmp_path / "deduped.safetensors"))  # one tied name
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"missing from the file: '(lm_head|tok_emb)\.weight'"):
        load_from_file(str(tmp_path / "deduped.safetensors"), untied_target)
    after = _snapshot(untied_target)
    assert all(torch.equal(after[k], v) for k, v in before.items())


@multi_rank(world_sizes=(2,))
def test_export_to_unwritable_path_fails_on_every_rank(tmp_path):
    from shardwise.checkpoint import export

    model = _shard(_plain(_cfg()))
    blocker = tmp_path / "a_file"
    if dist.get_rank() == 0:
        blocker.write_text("x")
    dist.barrier()
    with pytest.raises(Exception, match="rank 0 failed|File exists|Not a directory|a_file") as info:
        export(str(blocker / "model.safetensors"), model)
    assert info.type is not AssertionError
    # and the model still exports fine afterwards (nothing left unsharded)
    export(str(tmp_path / "ok.safetensors"), model)
    assert Path(tmp_path / "ok.safetensors").is_file()
