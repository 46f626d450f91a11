"""``--plot``: loss and memory over the steps as a PNG. With matplotlib
installed it draws the figure; otherwise a small built-in rasteriser does
(lines, axes, grid, tick labels in a 3 x 5 pixel font) and the PNG is written
by hand (zlib + struct), so shardwise needs no plotting dependency.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Canvas", "Panel", "png_bytes", "render", "write_plot"]

# 3 x 5 glyphs, '#' = ink. Enough for numbers, units and the panel titles.
_GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("###", "#.#", "#.#", "#.#", "###"), "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"), "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"), "7": ("###", "..#", "..#", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "###"),
    ".": ("...", "...", "...", "...", ".#."), "-": ("...", "...", "###", "...", "..."),
    "+": ("...", ".#.", "###", ".#.", "..."), "(": (".#.", "#..", "#..", "#..", ".#."),
    ")": (".#.", "..#", "..#", "..#", ".#."), "/": ("..#", "..#", ".#.", "#..", "#.."),
    ":": ("...", ".#.", "...", ".#.", "..."), ",": ("...", "...", "...", ".#.", "#.."),
    "a": ("...", ".##", "#.#", "#.#", ".##"), "b": ("#..", "#..", "##.", "#.#", "##."),
    "c": ("...", ".##", "#..", "#..", ".##"), "d": ("..#", "..#", ".##", "#.#", ".##"),
    "e": (".#.", "#.#", "###", "#..", ".##"), "f": (".##", "#..", "###", "#..", "#.."),
    "g": (".##", "#.#", ".##", "..#", "##."), "h": ("#..", "#..", "##.", "#.#", "#.#"),
    "i": (".#.", "...", ".#.", ".#.", ".#."), "k": ("#..", "#.#", "##.", "#.#", "#.#"),
    "l": ("##.", ".#.", ".#.", ".#.", "###"), "m": ("...", "##.", "###", "#.#", "#.#"),
    "n": ("...", "##.", "#.#", "#.#", "#.#"), "o": ("...", ".#.", "#.#", "#.#", ".#."),
    "p": ("...", "##.", "#.#", "##.", "#.."), "r": ("...", "#.#", "##.", "#..", "#.."),
    "s": (".##", "#..", ".#.", "..#", "##."), "t": (".#.", "###", ".#.", ".#.", ".##"),
    "u": ("...", "#.#", "#.#", "#.#", ".##"), "v": ("...", "#.#", "#.#", "#.#", ".#."),
    "w": ("...", "#.#", "#.#", "###", "#.#"), "x": ("...", "#.#", ".#.", "#.#", "#.#"),
    "y": ("#.#", "#.#", ".##", "..#", "##."), "A": (".#.", "#.#", "###", "#.#", "#.#"),
    "B": ("##.", "#.#", "##.", "#.#", "##."), "G": (".##", "#..", "#.#", "#.#", ".##"),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"), "M": ("#.#", "###", "###", "#.#", "#.#"),
    "R": ("##.", "#.#", "##.", "#.#", "#.#"), "S": (".##", "#..", ".#.", "..#", "##."),
    "T": ("###", ".#.", ".#.", ".#.", ".#."), "U": ("#.#", "#.#", "#.#", "#.#", "###"),
    " ": ("...", "...", "...", "...", "..."),
}

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
INK: RGB = (40, 40, 40)
GRID: RGB = (225, 225, 225)
COLOURS: tuple[RGB, ...] = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))


def png_bytes(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``width x height`` pixels, ``rgb`` row-major.

    Args:
        width: pixels per row (>= 1).
        height: rows (>= 1).
        rgb: ``3 * width * height`` bytes.
    """
    if width < 1 or height < 1 or len(rgb) != 3 * width * height:
        raise ValueError(
            f"png_bytes: rgb has {len(rgb)} bytes but a {width} x {height} RGB image needs {3 * width * height}; "
            "pass 3 bytes per pixel, row by row"
        )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class Canvas:
    """An RGB raster with the few drawing operations a line plot needs."""

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, colour: RGB) -> None:
        """Paint pixel ``(x, y)`` (ignored outside the canvas)."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(colour)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: RGB, thickness: int = 1) -> None:
        """A straight line (Bresenham), ``thickness`` pixels wide."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        r = thickness // 2
        while True:
            for ox in range(-r, thickness - r):
                for oy in range(-r, thickness - r):
                    self.set(x0 + ox, y0 + oy, colour)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, colour: RGB = INK, scale: int = 2) -> int:
        """Draw ``s`` with its top-left corner at ``(x, y)``; returns the width drawn."""
        cx = x
        for ch in s:
            glyph = _GLYPHS.get(ch) or _GLYPHS.get(ch.lower()) or _GLYPHS.get(ch.upper()) or _GLYPHS[" "]
            for gy, row in enumerate(glyph):
                for gx, cell in enumerate(row):
                    if cell == "#":
                        for sx in range(scale):
                            for sy in range(scale):
                                self.set(cx + gx * scale + sx, y + gy * scale + sy, colour)
            cx += 4 * scale
        return cx - x

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        """Pixels :meth:`text` takes for ``s``."""
        return 4 * scale * len(s)

    def png(self) -> bytes:
        """The canvas as PNG bytes."""
        return png_bytes(self.width, self.height, self.pixels)


@dataclass(frozen=True)
class Panel:
    """One line chart: a title and a series of ``(x, y)`` values."""

    title: str
    xs: Sequence[float]
    ys: Sequence[float]


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        if t >= lo - step * 1e-9:
            ticks.append(round(t, 10))
        t += step
    return ticks


def _label(v: float) -> str:
    return f"{v:.4g}"


def _draw_panel(c: Canvas, panel: Panel, top: int, height: int, colour: RGB, x_label: str) -> None:
    left, right = 80, c.width - 20
    plot_top, plot_bottom = top + 24, top + height - 30
    finite = [(x, y) for x, y in zip(panel.xs, panel.ys) if math.isfinite(y)]
    c.text(left, top + 4, panel.title)
    if not finite:
        return
    x_lo, x_hi = min(x for x, _ in finite), max(x for x, _ in finite)
    y_lo, y_hi = min(y for _, y in finite), max(y for _, y in finite)
    pad = (y_hi - y_lo) * 0.05 or abs(y_hi) * 0.05 or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad
    x_hi = x_hi if x_hi > x_lo else x_lo + 1

    def px(x: float) -> int:
        return left + int(round((x - x_lo) / (x_hi - x_lo) * (right - left)))

    def py(y: float) -> int:
        return plot_bottom - int(round((y - y_lo) / (y_hi - y_lo) * (plot_bottom - plot_top)))

    for t in _ticks(y_lo, y_hi):
        y = py(t)
        c.line(left, y, right, y, GRID)
        label = _label(t)
        c.text(left - 6 - Canvas.text_width(label), y - 5, label)
    for t in _ticks(x_lo, x_hi):
        x = px(t)
        c.line(x, plot_top, x, plot_bottom, GRID)
        label = _label(t)
        c.text(x - Canvas.text_width(label) // 2, plot_bottom + 6, label)
    c.line(left, plot_top, left, plot_bottom, INK)
    c.line(left, plot_bottom, right, plot_bottom, INK)
    c.text(right - Canvas.text_width(x_label), plot_bottom + 18, x_label)
    points = [(px(x), py(y)) for x, y in finite]
    if len(points) == 1:
        c.line(*points[0], *points[0], colour, thickness=3)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        c.line(x0, y0, x1, y1, colour, thickness=2)


def render(panels: Sequence[Panel], *, width: int = 720, panel_height: int = 260, x_label: str = "step") -> bytes:
    """PNG bytes of ``panels`` stacked vertically, with the built-in rasteriser.

    Args:
        panels: the charts, top to bottom.
        width: image width in pixels. (Default: ``720``)
        panel_height: pixels per chart. (Default: ``260``)
        x_label: the x axis' name. (Default: ``"step"``)
    """
    canvas = Canvas(width, panel_height * len(panels))
    for i, panel in enumerate(panels):
        _draw_panel(canvas, panel, i * panel_height, panel_height, COLOURS[i % len(COLOURS)], x_label)
    return canvas.png()


def _matplotlib(path: Path, panels: Sequence[Panel]) -> None:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.2, 2.6 * len(panels)), sharex=True)
    for ax, panel, colour in zip(list(axes) if len(panels) > 1 else [axes], panels, COLOURS):
        ax.plot(panel.xs, panel.ys, color=tuple(v / 255 for v in colour))
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step") if len(panels) > 1 else axes.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plot(path: str | os.PathLike[str], panels: Sequence[Panel], *, builtin: bool = False) -> str:
    """Write ``panels`` as a PNG at ``path`` (parent directories created);
    returns which renderer drew it (``"matplotlib"`` or ``"builtin"``).

    Args:
        path: the PNG file.
        panels: the charts, top to bottom.
        builtin: use the built-in rasteriser even when matplotlib is installed. (Default: ``False``)
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not builtin and importlib.util.find_spec("matplotlib") is not None:
        _matplotlib(target, panels)
        return "matplotlib"
    target.write_bytes(render(panels))
    return "builtin"
