"""The learning-rate schedule, the --plot PNG (matplotlib, the `plot` extra)
and the progress lines."""

from __future__ import annotations

import math
import struct

import pytest

from shardwise.errors import ConfigError
from shardwise.train.plot import Panel, write_plot
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


def test_plot_is_a_png_drawn_with_matplotlib(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    image = pytest.importorskip("matplotlib.image")
    backend = matplotlib.get_backend()
    steps = list(range(1, 51))
    out = tmp_path / "sub" / "plot.png"
    write_plot(out, [Panel("loss", steps, [5 / s for s in steps[:-1]] + [float("nan")]),
                     Panel("memory MiB", steps, [100.0] * 50)])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (720, 520)  # 7.2 x 2.6 inches per panel at 100 dpi
    rgb = (image.imread(out)[..., :3] * 255).round()
    top, bottom = rgb[:260], rgb[260:]

    def count(part, colour):
        return int((abs(part - colour).sum(axis=-1) < 30).sum())

    blue, red = (31, 119, 180), (214, 39, 40)  # the first and second panel's lines
    assert count(top, blue) > 100 and count(bottom, red) > 100 and count(bottom, blue) == 0
    assert matplotlib.get_backend() == backend  # drawn by Agg without switching pyplot's backend


def test_plot_without_matplotlib_is_refused_before_any_rank_starts(monkeypatch, capsys):
    import importlib.util

    from shardwise.cli import main
    from shardwise.train.config import TrainConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ConfigError, match=r"plot='loss.png' needs matplotlib.*pip install 'shardwise\[plot\]'"):
        TrainConfig(plot="loss.png")
    assert TrainConfig().plot == ""  # no plot, no matplotlib needed
    with pytest.raises(SystemExit) as exc:
        main(["train", "--plot", "loss.png", "--dry-run"])
    assert exc.value.code == 2 and "pip install 'shardwise[plot]'" in capsys.readouterr().err


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
