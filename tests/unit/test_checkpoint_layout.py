"""The on-disk layout and commit protocol of shardwise.checkpoint, in one
process: naming, the completion marker, ``latest``, pruning, file checks,
and a whole save/load of a plain model without a process group."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shardwise import checkpoint
from shardwise.checkpoint import commit
from shardwise.errors import CheckpointError


def _marker(step=None):
    return commit.Marker(files={"a.bin": commit.FileRecord(3, 0x12345678)}, world_size=4, step=step)


def test_step_directories_and_latest(tmp_path):
    assert checkpoint.checkpoint_path(tmp_path, 100) == tmp_path / "step-00000100"
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        checkpoint.checkpoint_path(tmp_path, -1)
    with pytest.raises(ValueError, match="got True"):
        checkpoint.checkpoint_path(tmp_path, True)
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    for step in (9, 10, 100):
        d = checkpoint.checkpoint_path(tmp_path, step)
        d.mkdir()
        commit.write_marker(d, _marker(step))
    # none of these count: no marker, a staging directory, a bad marker, a file
    (tmp_path / "step-00000200").mkdir()
    (tmp_path / ".step-00000300.tmp-abc").mkdir()
    commit.write_marker(tmp_path / ".step-00000300.tmp-abc", _marker(300))
    (tmp_path / "step-00000400").mkdir()
    (tmp_path / "step-00000400" / commit.MARKER_NAME).write_text('{"format": "other"}')
    (tmp_path / "step-00000500").write_text("a file")
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [9, 10, 100]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000100"
    # any name counts for latest (the one committed last), not for list_checkpoints / keep
    (tmp_path / "best").mkdir()
    commit.write_marker(tmp_path / "best", _marker())
    assert checkpoint.latest(tmp_path) == tmp_path / "best"
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [9, 10, 100]
    assert commit.prune(tmp_path, 2) == [tmp_path / "step-00000009"]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [10, 100]


def test_marker_round_trip_and_corruption(tmp_path):
    commit.write_marker(tmp_path, _marker(7))
    got = commit.read_marker(tmp_path)
    assert got.files == {"a.bin": commit.FileRecord(3, 0x12345678)} and got.step == 7 and got.world_size == 4
    raw = json.loads((tmp_path / commit.MARKER_NAME).read_text())
    assert raw["format"] == "shardwise-checkpoint" and raw["version"] == 1
    for bad in ("", "{", '{"format": "shardwise-checkpoint", "version": 99}', '{"format": "shardwise-checkpoint", "version": 1}'):
        (tmp_path / commit.MARKER_NAME).write_text(bad)
        with pytest.raises(CheckpointError, match="is corrupted"):
            commit.read_marker(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [commit.MARKER_NAME]  # no temporaries left


def test_check_files(tmp_path):
    (tmp_path / "a").write_bytes(b"hello world")
    (tmp_path / "b").write_bytes(b"x" * 100)
    marker = commit.Marker(
        files={"a": commit.checksum_file(tmp_path / "a"), "b": commit.checksum_file(tmp_path / "b")}, world_size=1
    )
    assert commit.check_files(tmp_path, marker, None) == []
    (tmp_path / "a").write_bytes(b"hellO world")
    (tmp_path / "b").write_bytes(b"x" * 50)
    assert commit.check_files(tmp_path, marker, []) == ["b has 50 bytes, 100 were written (truncated)"]
    assert commit.check_files(tmp_path, marker, ["a"]) == [
        "a is corrupted (its CRC-32 does not match the one written)",
        "b has 50 bytes, 100 were written (truncated)",
    ]
    (tmp_path / "a").unlink()
    assert commit.check_files(tmp_path, marker, None)[0] == "a is missing"


def test_atomic_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="stop"), commit.atomic_write(path) as f:
        f.write(b"new, half written")
        raise RuntimeError("stop")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]
    with commit.atomic_write(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"


def test_remove_uncommitted(tmp_path):
    final = tmp_path / "step-00000002"
    for name in (".step-00000002.tmp-a", ".step-00000002.old-b", ".step-00000003.tmp-c", "step-00000002"):
        (tmp_path / name).mkdir()
    commit.remove_uncommitted(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000003.tmp-c"]


class _Tiny(nn.Module):
    def __init__(self, width=3):
        super().__init__()
        self.fc = nn.Linear(width, 2)
        self.register_buffer("count", torch.tensor([5]))


def test_save_and_load_a_plain_model_without_a_process_group(tmp_path):
    """The same code paths run in one process with no process group."""
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.fc(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = checkpoint.save(tmp_path, model, opt, extra={"epoch": 3}, step=12)
    assert path == tmp_path / "step-00000012" and checkpoint.latest(tmp_path) == path
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "complete.json", "extra.pt"]
    marker = commit.read_marker(path)
    assert marker.step == 12 and marker.world_size == 1 and sorted(marker.files) == [".metadata", "__0_0.distcp", "extra.pt"]
    other = _Tiny()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
    assert checkpoint.load(path, other, other_opt) == {"epoch": 3}
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    assert other_opt.param_groups[0]["lr"] == 0.1
    buf = opt.state[model.fc.weight]["momentum_buffer"]
    assert torch.equal(other_opt.state[other.fc.weight]["momentum_buffer"], buf)
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \[2, 3\] in the checkpoint but \[2, 4\]"):
        checkpoint.load(path, _Tiny(width=4))
    # export / load_from_file work on plain models too
    checkpoint.export(tmp_path / "m.safetensors", model)
    fresh = _Tiny()
    checkpoint.load_from_file(tmp_path / "m.safetensors", fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_never_deletes_a_directory_it_did_not_write(tmp_path):
    import pytest

    from shardwise.checkpoint import commit as layout
    from shardwise.errors import CheckpointError

    mine = tmp_path / "my_data"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="refusing to replace it"):
        layout.remove_uncommitted(mine)
    assert (mine / "notes.txt").read_text() == "precious"
    # a half-committed leftover (data files, no marker) is cleaned up
    left = tmp_path / "step-00000001"
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(b"x")
    (left / ".metadata").write_bytes(b"x")
    layout.remove_uncommitted(left)
    assert not left.exists()
