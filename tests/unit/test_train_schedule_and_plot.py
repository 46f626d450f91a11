"""The learning-rate schedule and the built-in PNG writer / rasteriser."""

from __future__ import annotations

import math
import struct
import zlib

import pytest

from shardwise.train.plot import Canvas, Panel, png_bytes, render, write_plot
from shardwise.train.schedule import learning_rate


def test_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, steps=110)
    lrs = [learning_rate(s, **kw) for s in range(1, 121)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear up to the peak
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[9:110], lrs[10:110]))  # then only down
    assert learning_rate(60, **kw) == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert lrs[109] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert learning_rate(1, lr=2.0, min_lr=0.0, warmup_steps=0, steps=10) == pytest.approx(
        0.5 * 2.0 * (1 + math.cos(math.pi * 0.1)))
    with pytest.raises(ValueError, match="step=0"):
        learning_rate(0, **kw)


def _decode(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, interlace) == (8, 2, 0) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (3 * w + 1) : (y + 1) * (3 * w + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, b"".join(r[1:] for r in rows)


def test_png_bytes_round_trip():
    pixels = bytes(range(2 * 3 * 3)) * 1
    w, h, rgb = _decode(png_bytes(3, 2, pixels))
    assert (w, h, rgb) == (3, 2, pixels)
    with pytest.raises(ValueError, match="needs 18"):
        png_bytes(3, 2, b"\x00")


def test_canvas_draws_lines_and_text():
    c = Canvas(20, 10)
    c.line(0, 0, 19, 9, (255, 0, 0))
    assert c.pixels[0:3] == b"\xff\x00\x00" and c.pixels[-3:] == b"\xff\x00\x00"
    c.set(100, 100, (0, 0, 0))  # outside: ignored
    assert c.text(0, 0, "1.5", scale=1) == Canvas.text_width("1.5", scale=1) == 12


def test_render_plots_the_series(tmp_path):
    steps = list(range(1, 51))
    data = render([Panel("loss", steps, [5 / s for s in steps]), Panel("memory MiB", steps, [100.0] * 50)],
                  width=300, panel_height=120)
    w, h, rgb = _decode(data)
    assert (w, h) == (300, 240)
    blue = bytes((31, 119, 180))
    red = bytes((214, 39, 40))
    px = [rgb[i : i + 3] for i in range(0, len(rgb), 3)]
    top = [p for i, p in enumerate(px) if i // w < 120]
    bottom = [p for i, p in enumerate(px) if i // w >= 120]
    assert top.count(blue) > 100 and bottom.count(red) > 100 and blue not in bottom
    out = tmp_path / "sub" / "plot.png"
    assert write_plot(out, [Panel("loss", [1], [float("nan")])], builtin=True) == "builtin"
    assert _decode(out.read_bytes())[0] == 720


def test_progress_lines(monkeypatch):
    import io
    import os

    from shardwise.train.report import Progress, fmt_bytes, table

    out = io.StringIO()
    p = Progress(10, every=5, stream=out, live=False)
    for step in range(1, 11):
        p.update(step, float(step), 1000.0, 2**20, 1e-3)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step  1/10 | loss  1.0000")
    assert "loss  3.5000" in lines[1]  # the mean over steps 2..5
    assert "1.00 MiB" in lines[2] and fmt_bytes(512) == "512 B"
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=None: os.terminal_size((60, 20)))
    live = io.StringIO()
    p = Progress(10, stream=live, live=True)
    p.update(10, 1.0, 1.0, 1, 1.0)
    p.close()
    drawn = live.getvalue().split("\r")[-1]
    assert len(drawn.replace("\x1b[2K", "").rstrip("\n")) <= 59
    assert table(["a", "bb"], [["1", "22"]]).splitlines()[1] == "-  --"
