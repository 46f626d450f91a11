"""Training data: per-rank slices, the deterministic window order and its
position, the three sources (text files, uint16 .bin, Python's own text)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.train.data import STDLIB_CORPUS_BYTES, Batches, open_source, slice_bounds


@pytest.mark.parametrize("length", [0, 1, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_slices_partition_the_stream(length, world):
    bounds = [slice_bounds(length, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


def _text(tmp_path, n=1000):
    data = bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).to(torch.uint8).tolist())
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(data[:n // 2])
    (tmp_path / "d" / "b.txt").write_bytes(data[n // 2 : n])
    (tmp_path / "d" / ".hidden").write_bytes(b"x" * 50)
    return data[:n]


def test_text_files_are_one_byte_stream_read_by_range(tmp_path):
    data = _text(tmp_path)
    source = open_source([str(tmp_path / "d")])
    assert source.length == len(data) and source.vocab_size == 256
    assert source.read(490, 520).tolist() == list(data[490:520])  # across the file boundary
    assert source.read(990, 5000).tolist() == list(data[990:])


def test_each_rank_reads_only_its_slice_in_a_seeded_order(tmp_path):
    data = torch.tensor(list(_text(tmp_path)))
    source = open_source([str(tmp_path / "d")])
    seq = 16
    seen = []
    for rank in range(2):
        batches = Batches(source, seq, 2, rank, seed=3)
        start, end = slice_bounds(len(data), 2, rank)
        assert batches.num_windows == (end - start - 1) // seq
        starts = set()
        for i in range(batches.num_windows):
            w = batches.window(i)
            # find where it lies: it must be inside this rank's slice, on the seq_len grid
            offset = next(o for o in range(start, end - seq) if torch.equal(data[o : o + seq + 1], w)
                          and (o - start) % seq == 0)
            starts.add(offset)
        assert len(starts) == batches.num_windows  # one epoch = every window once
        seen.append(starts)
    assert not seen[0] & seen[1]
    # same seed -> same order; another seed -> another order
    a, b, c = (Batches(source, seq, 2, 0, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.next(4)[0], b.next(4)[0]) and not torch.equal(a.next(4)[0], c.next(8)[0][4:])


def test_position_is_the_whole_state(tmp_path):
    _text(tmp_path, 4000)
    source = open_source([str(tmp_path / "d")])
    straight = Batches(source, 8, 2, 1, seed=0)
    batches = [straight.next(5) for _ in range(60)]  # several epochs (~249 windows each)
    resumed = Batches(source, 8, 2, 1, seed=0, position=5 * 40)
    for x, y in batches[40:]:
        rx, ry = resumed.next(5)
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64 and x.shape == (5, 8)


def _micro_batch(source, world, data_world, position, per_rank):
    """The whole micro-batch (every rank's rows, in rank order) at ``position``."""
    rows = []
    for rank in range(world):
        batches = Batches(source, 8, world, rank, seed=2, position=position, data_world=data_world)
        rows.append(batches.next(per_rank)[0])
        assert batches.position == position + world * per_rank // data_world
    return torch.cat(rows)


def test_another_world_size_cuts_the_same_micro_batches(tmp_path):
    """Started on 4 ranks (data world 4), resumed on 1, 2, 3 or 6: every
    micro-batch holds the same sequences, in the same order, as on 4."""
    _text(tmp_path, 4000)
    source = open_source([str(tmp_path / "d")])
    for position in (0, 3, 9, 150):  # 150: past the first epoch of each slice (~124 windows)
        want = _micro_batch(source, 4, 4, position, 3)  # 12 sequences, 3 from each slice
        for world in (1, 2, 3, 6):
            got = _micro_batch(source, world, 4, position, 12 // world)
            assert torch.equal(got, want), (position, world)
    # a fresh run on 4 ranks is the data world 4 (each rank reads its own slice only)
    fresh = Batches(source, 8, 4, 2, seed=2)
    assert fresh.data_world == 4 and torch.equal(fresh.next(3)[0], _micro_batch(source, 4, 4, 0, 3)[6:9])
    assert list(fresh._slices) == [2]
    # 2 ranks of 5 rows = 10 sequences cannot take the same number from each of 4 slices
    with pytest.raises(ConfigError, match="cannot take the same number from each of the data's 4 slices"):
        Batches(source, 8, 2, 0, seed=2, data_world=4).next(5)


def test_uint16_bin_like_nanogpt(tmp_path):
    ids = (np.arange(5000) * 37 % 50257).astype(np.uint16)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    source = open_source([str(path)])
    assert source.length == 5000 and source.is_bin
    assert source.vocab_size == 50304  # largest id + 1 (50257), rounded up to 64
    assert source.read(100, 110).tolist() == ids[100:110].astype(int).tolist()
    x, y = Batches(source, 32, 4, 2, seed=0).next(3)
    assert x.max() < 50257 and torch.equal(x[:, 1:], y[:, :-1])
    # not scanned (vocab_size given): unknown, so any configured vocabulary passes the check before the ranks start
    assert open_source([str(path)], scan_vocab=False).vocab_size == 0


def _llmc(path, ids, magic, version, count=None):
    # llm.c's write_datafile: 256 int32s (magic, version, token count), then the ids
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + ids.tobytes())
    return path


LLAMA3_VOCAB = 128256


def _big_ids(n=6000):
    return (np.arange(n, dtype=np.int64) * 7919 % LLAMA3_VOCAB).astype(np.uint32)


def test_uint32_bin_with_ids_past_uint16(tmp_path):
    ids = _big_ids()
    ids[123] = LLAMA3_VOCAB - 1
    path = tmp_path / "llama.uint32.bin"  # raw ids; the name says their width
    ids.tofile(path)
    source = open_source([str(path)])
    assert source.length == len(ids) and source.dtype == torch.uint32 and "uint32" in source.description
    assert source.vocab_size == LLAMA3_VOCAB  # 128255 + 1, a multiple of 64 already
    assert source.read(120, 130).tolist() == ids[120:130].astype(int).tolist()
    seq = 32
    for rank in range(2):
        batches = Batches(source, seq, 2, rank, seed=1)
        start, _ = slice_bounds(len(ids), 2, rank)
        x, y = batches.next(8)
        assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        for row, i in zip(x, range(8)):  # every row is one seq_len window of this rank's slice, exactly
            lo = start + int(batches._home._order(0)[i]) * seq
            assert row.tolist() == ids[lo : lo + seq].astype(int).tolist()
    assert int(Batches(source, seq, 1, 0, seed=0).next(len(ids) // seq)[0].max()) > 65535


def test_llmc_headers_say_the_width(tmp_path):
    ids = _big_ids(3000)
    source = open_source([str(_llmc(tmp_path / "fineweb_train_000001.bin", ids, 20240801, 7))])
    assert (source.length, source.dtype) == (3000, torch.uint32) and "llm.c header" in source.description
    assert source.read(0, 5).tolist() == ids[:5].astype(int).tolist()  # the header is not read as tokens
    gpt2 = (np.arange(3000) % 50257).astype(np.uint16)
    source = open_source([str(_llmc(tmp_path / "gpt2.bin", gpt2, 20240520, 1))])
    assert (source.length, source.dtype, source.vocab_size) == (3000, torch.uint16, 3008)
    assert source.read(2990, 3000).tolist() == gpt2[2990:].astype(int).tolist()
    with pytest.raises(ConfigError, match="header .* for 3,001 tokens, but holds 12,000 bytes after it"):
        open_source([str(_llmc(tmp_path / "short.bin", ids, 20240801, 7, count=3001))])
    with pytest.raises(ConfigError, match="named uint16 but its llm.c header says uint32"):
        open_source([str(_llmc(tmp_path / "x.uint16.bin", ids, 20240801, 7))])
    odd = tmp_path / "odd.uint32.bin"
    odd.write_bytes(b"\0" * 6)
    with pytest.raises(ConfigError, match="6 bytes: a .bin must hold uint32 token ids .* multiple of 4 bytes"):
        open_source([str(odd)])


def test_bin_is_mapped_once_and_never_widened(tmp_path, monkeypatch):
    import mmap
    import pickle

    import shardwise.train.data as data

    maps = []
    real = mmap.mmap
    monkeypatch.setattr(data.mmap, "mmap", lambda *a, **k: maps.append(a) or real(*a, **k))
    path = tmp_path / "t.uint32.bin"
    _big_ids(20000).tofile(path)
    source = open_source([str(path)])  # scans the ids for the vocabulary through the mapping
    ranks = [Batches(source, 16, 2, r, seed=0) for r in range(2)]
    opened = []
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a) or pytest.fail("reopened the .bin"))
    for _ in range(50):
        for b in ranks:
            b.next(4)
    assert len(maps) == 1 and not opened  # one mapping per process, windows are views of it
    monkeypatch.undo()
    mapped = source.tokens()
    base, end = mapped.data_ptr(), mapped.data_ptr() + mapped.numel() * 4
    for b in ranks:  # each rank's slice: uint32 views into the mapping, not an int64 copy (8 bytes a token)
        assert b._tokens.dtype == torch.uint32 and base <= b._tokens.data_ptr() < end
    clone = pickle.loads(pickle.dumps(source))  # as sent to a spawned rank: maps the file anew there
    assert clone._mapped is None and torch.equal(clone.read(0, 100), source.read(0, 100))
    text = tmp_path / "a.txt"
    text.write_bytes(bytes(range(256)) * 4)
    assert Batches(open_source([str(text)]), 8, 2, 1, seed=0)._tokens.dtype == torch.uint8  # text: a byte a token


def test_bad_data_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        open_source([str(tmp_path / "missing.txt")])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="3 bytes: a .bin must hold uint16"):
        open_source([str(odd)])
    (tmp_path / "t.txt").write_bytes(b"hi")
    with pytest.raises(ConfigError, match="mixes a .bin"):
        open_source([str(odd), str(tmp_path / "t.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="holds no bytes"):
        open_source([str(empty)])
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        Batches(open_source([str(tmp_path / "t.txt")]), 8, 1, 0, seed=0)


def test_default_corpus_is_pythons_own_text():
    source = open_source([])
    assert source.length == STDLIB_CORPUS_BYTES and "stdlib" in source.description
    head = bytes(source.read(0, 2000).tolist()).decode("utf-8", "replace")
    assert "topics" in head or "docstring" in head.lower() or "def " in head or '"""' in head
