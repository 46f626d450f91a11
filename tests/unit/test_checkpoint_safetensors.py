"""The safetensors writer and reader of shardwise.checkpoint, against the
official ``safetensors`` library in both directions and at the byte level."""

from __future__ import annotations

import io
import json
import struct

import pytest
import safetensors.torch as safetensors_torch  # the official library (test extra)
import torch

from shardwise.checkpoint import safetensors_format as st
from shardwise.errors import CheckpointError


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 4, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(6, generator=g).to(torch.float16),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i64": torch.arange(-5, 7),
        "i32": torch.arange(10, dtype=torch.int32).reshape(2, 5),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }
    return out


def _equal(a, b):
    """Same dtype, shape and bytes (works for every dtype, fp8 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def test_our_files_read_with_the_official_library(tmp_path):
    tensors = _tensors()
    path = tmp_path / "ours.safetensors"
    st.save_file(tensors, path, metadata={"format": "pt", "note": "hi"})
    loaded = safetensors_torch.load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for k, v in tensors.items():
        assert _equal(loaded[k], v), k
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "hi"}
        assert torch.equal(f.get_slice("f32")[1:3], tensors["f32"][1:3])


def test_official_files_read_by_us(tmp_path):
    tensors = _tensors()
    path = tmp_path / "theirs.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"a": "b"})
    loaded = st.load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for k, v in tensors.items():
        assert _equal(loaded[k], v), k
    with open(path, "rb") as f:
        assert st.read_header(f, str(path)).metadata == {"a": "b"}


def test_bytes_on_disk(tmp_path):
    a = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    b = torch.tensor([7, 8, 9], dtype=torch.int16)
    path = tmp_path / "x.safetensors"
    st.save_file({"a": a, "b": b}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b" ", b"}")
    header = json.loads(raw[8 : 8 + n])
    assert header == {
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "I16", "shape": [3], "data_offsets": [16, 22]},
    }
    assert raw[8 + n :] == struct.pack("<4f", 1.0, -2.0, 0.5, 3.0) + struct.pack("<3h", 7, 8, 9)


@pytest.mark.parametrize("shape", [(7,), (5, 6), (4, 3, 5), (2, 3, 4, 5)])
def test_read_box_is_the_slice_and_reads_only_its_bytes(tmp_path, shape, monkeypatch):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    path = tmp_path / "t.safetensors"
    st.save_file({"t": full}, path)
    read = []
    real = st._readinto_tensor
    monkeypatch.setattr(st, "_readinto_tensor", lambda f, out, what: (read.append(out.numel()), real(f, out, what)))
    g = torch.Generator().manual_seed(len(shape))
    with open(path, "rb") as f:
        header = st.read_header(f)
        for _ in range(20):
            offset = [int(torch.randint(0, d, (1,), generator=g)) for d in shape]
            size = [int(torch.randint(0, d - o + 1, (1,), generator=g)) for d, o in zip(shape, offset)]
            read.clear()
            box = st.read_box(f, header, "t", offset, size)
            expected = full[tuple(slice(o, o + s) for o, s in zip(offset, size))]
            assert torch.equal(box, expected), (offset, size)
            assert sum(read) == expected.numel()
        # a shard along dim 0 is one read
        read.clear()
        st.read_box(f, header, "t", [1] + [0] * (len(shape) - 1), [shape[0] - 1] + list(shape[1:]))
        assert len(read) == 1
        with pytest.raises(CheckpointError, match="outside 't'"):
            st.read_box(f, header, "t", [0] * len(shape), [d + 1 for d in shape])


def _file(header: dict, data: bytes, *, length: int | None = None) -> io.BytesIO:
    text = json.dumps(header).encode()
    return io.BytesIO(struct.pack("<Q", len(text) if length is None else length) + text + data)


@pytest.mark.parametrize(
    "header,data,length,match",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, None, "holds 12"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12 bytes"),
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype 'X9'"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"", None, "non-negative ints"),
        (
            {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
             "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}},
            b"\0" * 3, None, "not contiguous",
        ),
        ({"a": {"dtype": "U8", "shape": [2]}}, b"\0\0", None, "exactly dtype, shape and data_offsets"),
        ({"__metadata__": {"k": 1}}, b"", None, "must map strings to strings"),
        ({}, b"", 10**9, "header length says"),
    ],
)
def test_bad_headers(header, data, length, match):
    with pytest.raises(CheckpointError, match=match):
        st.read_header(_file(header, data, length=length))


def test_bad_header_bytes():
    with pytest.raises(CheckpointError, match="fewer than the 8-byte header length"):
        st.read_header(io.BytesIO(b"\1\2"))
    text = b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "a": {}}'
    with pytest.raises(CheckpointError, match=r"names \['a'\] more than once"):
        st.read_header(io.BytesIO(struct.pack("<Q", len(text)) + text))
    with pytest.raises(CheckpointError, match="not JSON"):
        st.read_header(io.BytesIO(struct.pack("<Q", 3) + b"{{{"))


def test_writer_checks_order_dtype_and_completeness():
    buf = io.BytesIO()
    w = st.SafetensorsWriter(buf, [("a", torch.float32, (2,)), ("b", torch.int64, (1,))])
    assert w.next_name == "a"
    with pytest.raises(CheckpointError, match="got 'b' but 'a' is next"):
        w.write("b", torch.zeros(1, dtype=torch.int64))
    with pytest.raises(CheckpointError, match=r"planned torch.float32 \[2\], got torch.float64 \[2\]"):
        w.write("a", torch.zeros(2, dtype=torch.float64))
    w.write("a", torch.ones(2))
    with pytest.raises(CheckpointError, match=r"closed before writing \['b'\]"):
        w.close()
    w.write("b", torch.tensor([5]))
    w.close()
    buf.seek(0)
    header = st.read_header(buf)
    assert torch.equal(st.read_tensor(buf, header, "b"), torch.tensor([5]))
    with pytest.raises(CheckpointError, match="appears twice"):
        st.plan_header([("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(CheckpointError, match="reserved"):
        st.plan_header([("__metadata__", torch.float32, (1,))])
    with pytest.raises(CheckpointError, match="cannot store"):
        st.plan_header([("q", torch.quint8, (1,))])


def test_save_file_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="cannot store"):
        st.save_file({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.complex128)}, path)
    real, calls = st._tensor_bytes, []

    def fail_second(t):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(t)

    monkeypatch.setattr(st, "_tensor_bytes", fail_second)
    with pytest.raises(OSError, match="disk full"):
        st.save_file({"a": torch.zeros(3), "b": torch.zeros(2)}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
