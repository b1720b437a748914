"""Figures for a run directory, drawn with Pillow alone (no matplotlib in the product).

- :func:`plot_curves`: per-epoch losses and accuracies, one or several runs (e.g. distilled vs scratch).
- :func:`plot_confusion`: confusion-matrix heat map with counts, class names on both axes.
- :func:`contact_sheet`: a grid of images with captions (the hardest misclassified test images).
- :func:`feature_map_grid`: first-convolution feature maps of a few images, one image per row.

Everything is drawn at twice the final size and downsampled with a Lanczos filter, which gives
anti-aliased lines and text without a vector renderer. Text uses Pillow's bundled Aileron font at any
size (``ImageFont.load_default(size=...)``, Pillow >= 10.1) and falls back to the old bitmap font,
scaled, on Pillow builds without FreeType. Every function writes its PNG atomically (a temporary file
beside the target, then ``os.replace``) and returns the path.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_SS = 2  # supersampling factor: draw at _SS x the final size, then downsample
_BG = (255, 255, 255)
_FG = (34, 34, 34)
_GRID = (226, 226, 226)
_AXIS = (90, 90, 90)
#: Line colours (the "tab10" palette: distinct, colour-blind-tolerant).
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
_DASHES: list[tuple[int, int] | None] = [None, (9, 6), (2, 5), (12, 4)]  # solid, dashed, dotted, long dash
# Viridis anchor colours (perceptually uniform, readable in grey), interpolated into a 256-entry table.
_VIRIDIS = [(68, 1, 84), (72, 40, 120), (62, 74, 137), (49, 104, 142), (38, 130, 142), (31, 158, 137),
            (53, 183, 121), (109, 205, 89), (180, 222, 44), (253, 231, 37)]
_BLUES = [(247, 251, 255), (198, 219, 239), (107, 174, 214), (33, 113, 181), (8, 48, 107)]
_UNICODE_FONTS = ("DejaVuSans.ttf", "NotoSans-Regular.ttf", "LiberationSans-Regular.ttf", "Arial.ttf")

PathLike = str | os.PathLike[str]


# ---- small drawing toolkit -----------------------------------------------------------------------
def _lut(anchors: Sequence[tuple[int, int, int]]) -> np.ndarray:
    a = np.asarray(anchors, dtype=np.float64)
    x = np.linspace(0, 1, len(a))
    t = np.linspace(0, 1, 256)
    return np.stack([np.interp(t, x, a[:, c]) for c in range(3)], axis=1).round().astype(np.uint8)


VIRIDIS_LUT = _lut(_VIRIDIS)
BLUES_LUT = _lut(_BLUES)


@functools.lru_cache(maxsize=64)
def _font(px: int, unicode: bool = False) -> ImageFont.FreeTypeFont | None:
    """A scalable font of ``px`` pixels, or None when only the bitmap font exists (no FreeType).

    ASCII text uses Pillow's bundled Aileron; text with other characters (accents, other scripts), which
    Aileron's reduced character set lacks, uses a system Unicode font when one is installed.
    """
    if unicode:
        for name in _UNICODE_FONTS:
            try:
                return ImageFont.truetype(name, px)
            except OSError:
                continue
    try:
        font = ImageFont.load_default(size=px)
    except (TypeError, OSError, ImportError):  # Pillow < 10.1, or built without FreeType
        return None
    return font if isinstance(font, ImageFont.FreeTypeFont) else None


def _text_mask(text: str, px: int) -> Image.Image:
    """An "L" image of ``text`` at ``px`` pixels; its height is the font's full line height, so that
    strings with and without descenders line up."""
    px = max(4, int(round(px)))
    font = _font(px, unicode=not text.isascii())
    if font is not None:
        ascent, descent = font.getmetrics()
        width = max(1, int(math.ceil(font.getlength(text))))
        mask = Image.new("L", (width, ascent + descent), 0)
        ImageDraw.Draw(mask).text((0, 0), text, font=font, fill=255)
        return mask
    bitmap = ImageFont.load_default()
    native_h = max(1, bitmap.getbbox("Ag|")[3])
    width = max(1, bitmap.getbbox(text)[2]) if text else 1
    mask = Image.new("L", (width, native_h), 0)
    ImageDraw.Draw(mask).text((0, 0), text, font=bitmap, fill=255)
    factor = px / native_h
    size = (max(1, round(width * factor)), max(1, round(native_h * factor)))
    return mask.resize(size, Image.Resampling.BICUBIC)


class _Canvas:
    """An RGB image drawn at ``_SS`` times its final size; coordinates are given in final-size pixels."""

    def __init__(self, width: int, height: int, background: tuple[int, int, int] = _BG) -> None:
        self.width, self.height = int(width), int(height)
        self.img = Image.new("RGB", (self.width * _SS, self.height * _SS), background)
        self.draw = ImageDraw.Draw(self.img)

    @staticmethod
    def s(v: float) -> int:
        return int(round(v * _SS))

    def text_size(self, text: str, px: float) -> tuple[float, float]:
        w, h = _text_mask(text, px * _SS).size
        return w / _SS, h / _SS

    def text(self, x: float, y: float, text: str, px: float, fill: tuple[int, int, int] = _FG,
             anchor: str = "lt", angle: float = 0) -> None:
        """Draw ``text`` with ``anchor`` = horizontal (l/m/r) + vertical (t/m/b) of its (rotated) box."""
        if not text:
            return
        mask = _text_mask(text, px * _SS)
        if angle:
            mask = mask.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True)
        w, h = mask.size
        left = self.s(x) - {"l": 0, "m": w // 2, "r": w}[anchor[0]]
        top = self.s(y) - {"t": 0, "m": h // 2, "b": h}[anchor[1]]
        self.img.paste(Image.new("RGB", mask.size, fill), (left, top), mask)

    def line(self, points: Sequence[tuple[float, float]], fill: tuple[int, int, int], width: float = 1.0,
             dash: tuple[int, int] | None = None) -> None:
        pts = [(self.s(x), self.s(y)) for x, y in points]
        w = max(1, self.s(width))
        if len(pts) < 2:
            return
        if dash is None:
            self.draw.line(pts, fill=fill, width=w, joint="curve")
            return
        on, off = dash[0] * _SS * max(1.0, width / 1.5), dash[1] * _SS * max(1.0, width / 1.5)
        phase, drawing = 0.0, True  # the dash pattern continues across segment joins
        for (x0, y0), (x1, y1) in zip(pts[:-1], pts[1:]):
            seg = math.hypot(x1 - x0, y1 - y0)
            pos = 0.0
            while pos < seg:
                left = (on if drawing else off) - phase
                step = min(left, seg - pos)
                if drawing:
                    a, b = pos / seg, (pos + step) / seg
                    self.draw.line([(x0 + (x1 - x0) * a, y0 + (y1 - y0) * a),
                                    (x0 + (x1 - x0) * b, y0 + (y1 - y0) * b)], fill=fill, width=w)
                pos += step
                phase += step
                if phase >= (on if drawing else off) - 1e-9:
                    phase, drawing = 0.0, not drawing

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: tuple[int, int, int] | None = None,
             outline: tuple[int, int, int] | None = None, width: float = 1.0) -> None:
        self.draw.rectangle([self.s(x0), self.s(y0), self.s(x1) - 1, self.s(y1) - 1], fill=fill,
                            outline=outline, width=max(1, self.s(width)) if outline else 0)

    def dot(self, x: float, y: float, r: float, fill: tuple[int, int, int]) -> None:
        self.draw.ellipse([self.s(x - r), self.s(y - r), self.s(x + r), self.s(y + r)], fill=fill)

    def paste(self, image: Image.Image, x: float, y: float) -> None:
        """Paste a final-size image (scaled up by ``_SS`` with nearest neighbour, so pixels stay crisp)."""
        big = image.resize((image.width * _SS, image.height * _SS), Image.Resampling.NEAREST)
        self.img.paste(big, (self.s(x), self.s(y)))

    def finish(self) -> Image.Image:
        return self.img.resize((self.width, self.height), Image.Resampling.LANCZOS)


def _save(image: Image.Image, path: PathLike) -> Path:
    """Write ``image`` as PNG atomically: a temporary file in the same folder, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _ellipsize(text: str, max_chars: int) -> str:
    """Shorten ``text`` to ``max_chars`` by cutting its middle ("Tomato___Sep...variant_3"): class names
    that share a long prefix stay distinguishable by their ends."""
    if len(text) <= max_chars:
        return text
    keep = max(2, max_chars - 3)
    head = (keep + 1) // 2
    return text[:head] + "..." + text[len(text) - (keep - head):]


def _wrap(canvas: _Canvas, text: str, px: float, width: float, max_lines: int) -> list[str]:
    """Greedy word wrap into at most ``max_lines`` lines of ``width`` pixels (the last one ellipsized)."""
    words, lines, current = text.split(), [], ""
    for word in words:
        trial = f"{current} {word}".strip()
        if current and canvas.text_size(trial, px)[0] > width:
            lines.append(current)
            current = word
        else:
            current = trial
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1] + "..."
    for i, line in enumerate(lines):  # a single over-long word: cut it
        while len(line) > 4 and canvas.text_size(line, px)[0] > width:
            line = line[:-4] + "..."
        lines[i] = line
    return lines


def nice_ticks(lo: float, hi: float, target: int = 5,
               integer: bool = False) -> tuple[float, float, list[float]]:
    """Axis limits widened to round numbers and the tick values between them (steps of 1, 2, 2.5 or 5
    times a power of ten; whole numbers only when ``integer``)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"axis limits must be finite, got {lo}, {hi}")
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or (1.0 if integer else 0.1)
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw - 1e-15)
    if integer:
        step = max(1.0, float(round(step))) if step >= 1 else 1.0
    lo_t, hi_t = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    count = int(round((hi_t - lo_t) / step))
    return lo_t, hi_t, [lo_t + i * step for i in range(count + 1)]


def log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Log-axis limits (powers of ten around [lo, hi]) and ticks: each decade, plus 2 and 5 times it
    when the axis spans at most four decades."""
    if not (0 < lo <= hi and math.isfinite(hi)):
        raise ValueError(f"log axis limits must be positive and finite, got {lo}, {hi}")
    d0, d1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if d1 == d0:
        d1 += 1
    mults = (1, 2, 5) if d1 - d0 <= 4 else (1,)
    ticks = [m * 10.0**d for d in range(d0, d1) for m in mults] + [10.0**d1]
    # trim to the data, keeping one tick beyond each end
    below = [t for t in ticks if t <= lo]
    above = [t for t in ticks if t >= hi]
    lo_t, hi_t = (below[-1] if below else ticks[0]), (above[0] if above else ticks[-1])
    return lo_t, hi_t, [t for t in ticks if lo_t <= t <= hi_t]


def _tick_label(v: float, step: float) -> str:
    """``v`` with as many decimals as the tick step needs (0.05 -> 2, 2.5 -> 1, 10 -> 0)."""
    digits = f"{abs(step):.9f}".rstrip("0").split(".")[1]
    decimals = len(digits)
    text = f"{v:.{decimals}f}"
    return "0" if float(text) == 0 else text


# ---- training curves -----------------------------------------------------------------------------
def _series_values(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    pts = []
    for i, row in enumerate(history):
        v = row.get(key)
        if v is None or isinstance(v, bool):
            continue
        try:
            v = float(v)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(v):
            continue
        x = row.get("epoch", i + 1)
        try:
            x = float(x)
        except (TypeError, ValueError):
            x = float(i + 1)
        pts.append((x, v))
    return pts


def plot_curves(
    history: Sequence[Mapping[str, Any]] | None,
    path: PathLike,
    keys_left: Sequence[str] = ("train_loss", "val_loss"),
    keys_right: Sequence[str] = ("train_acc", "val_acc"),
    title: str = "Training curves",
    series: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    panel_titles: tuple[str, str] = ("loss", "accuracy"),
    width: int = 1200,
    log_scale: str = "auto",
) -> Path:
    """Line charts of per-epoch metrics: ``keys_left`` in the left panel, ``keys_right`` in the right one
    (an empty key list drops that panel). The x axis is each row's ``epoch`` (else its position, from 1);
    missing, None or non-finite values are skipped, so rows may carry different keys.

    ``series`` maps a run name to its history to compare runs (e.g. {"distilled": h1, "scratch": h2}):
    then the colour names the run and the line style the metric; with one run the colour names the metric.
    ``history`` is used when ``series`` is None. Best values are marked on keys starting with "val_"
    (the highest accuracy, the lowest loss). ``log_scale`` ("auto", "on", "off"): "auto" draws a panel's
    y axis on a log scale when its positive values span more than a factor of 30, so that a summed
    distillation loss does not flatten a cross-entropy curve drawn beside it.
    """
    if log_scale not in ("auto", "on", "off"):
        raise ValueError(f"plot_curves: log_scale must be 'auto', 'on' or 'off', got {log_scale!r}")
    if series is None:
        series = {"": list(history or [])}
    elif history and all(h is not history for h in series.values()):
        raise ValueError("plot_curves: pass either history or series (history is not one of the series)")
    if not series:
        raise ValueError("plot_curves: no history to draw")
    panels = [(panel_titles[i], list(keys)) for i, keys in enumerate((keys_left, keys_right)) if keys]
    if not panels:
        raise ValueError("plot_curves: keys_left and keys_right are both empty")

    multi = len(series) > 1 or any(name for name in series)
    panel_w = width / len(panels)
    legend_px, tick_px = 13, 12
    # Legend entries per panel, to size the legend rows under each panel.
    probe = _Canvas(8, 8)
    entries_per_panel = []
    for _, keys in panels:
        entries = []
        for s_i, name in enumerate(series):
            for k_i, key in enumerate(keys):
                colour = PALETTE[s_i % len(PALETTE)] if multi else PALETTE[k_i % len(PALETTE)]
                dash = _DASHES[k_i % len(_DASHES)] if multi else None
                label = f"{name}: {key}" if multi else key
                pts = _series_values(series[name], key)
                if not pts:  # nothing recorded: no line, no legend entry
                    continue
                if key.startswith("val_"):
                    best = (max if "acc" in key else min)(pts, key=lambda p: p[1])
                    value = f"{best[1]:.3f}" if "acc" in key else f"{best[1]:.4g}"
                    label += f" (best {value} @ {best[0]:g})"
                entries.append((label, colour, dash, name, key))
        entries_per_panel.append(entries)
    legend_rows = []
    for entries in entries_per_panel:
        rows, row_w = 1, 0.0
        for label, *_ in entries:
            w = 34 + probe.text_size(label, legend_px)[0] + 18
            if row_w + w > panel_w - 40 and row_w > 0:
                rows, row_w = rows + 1, 0.0
            row_w += w
        legend_rows.append(rows)
    plot_h, top = 380, 56
    legend_h = 22 * max(legend_rows) + 8
    height = int(top + 28 + plot_h + 52 + legend_h)
    canvas = _Canvas(width, height)
    canvas.text(width / 2, 14, title, 20, anchor="mt")

    for p_i, (panel_title, keys) in enumerate(panels):
        x_off = p_i * panel_w
        left, right = x_off + 72, x_off + panel_w - 24
        y_top, y_bot = top + 28, top + 28 + plot_h
        canvas.text((left + right) / 2, top + 4, panel_title, 15, anchor="mt")
        data = {(name, key): _series_values(hist, key) for name, hist in series.items() for key in keys}
        all_pts = [pt for pts in data.values() for pt in pts]
        if not all_pts:
            canvas.rect(left, y_top, right, y_bot, outline=_AXIS)
            canvas.text((left + right) / 2, (y_top + y_bot) / 2, "no data recorded for " + ", ".join(keys),
                        13, fill=_AXIS, anchor="mm")
            continue
        xs = [p[0] for p in all_pts]
        ys = [p[1] for p in all_pts]
        x0, x1, xticks = nice_ticks(min(xs), max(xs), target=8, integer=True)
        if min(xs) == max(xs):
            x0, x1, xticks = min(xs) - 1, max(xs) + 1, [min(xs) - 1, min(xs), min(xs) + 1]
        log_y = log_scale == "on" or (log_scale == "auto" and min(ys) > 0 and max(ys) / min(ys) > 30)
        if log_y:  # losses of very different sizes (e.g. a summed distillation loss next to a CE loss)
            if min(ys) <= 0:
                raise ValueError("plot_curves: a log scale needs positive values")
            y0, y1, yticks = log_ticks(min(ys), max(ys))
            yfun: Any = math.log10
            labels = [f"{v:g}" for v in yticks]
        else:
            span = max(ys) - min(ys)
            lo_pad, hi_pad = min(ys) - 0.04 * span, max(ys) + 0.04 * span
            if min(ys) >= 0:  # losses and accuracies: no negative axis, and fractions stop at 1
                lo_pad = max(0.0, lo_pad)
                if max(ys) <= 1 and span > 0:
                    hi_pad = min(1.0, hi_pad)
            y0, y1, yticks = nice_ticks(lo_pad, hi_pad, target=6)
            yfun = float
            ystep = yticks[1] - yticks[0] if len(yticks) > 1 else 1.0
            labels = [_tick_label(v, ystep) for v in yticks]

        def tx(v: float, x0: float = x0, x1: float = x1, left: float = left, right: float = right) -> float:
            return left + (v - x0) / (x1 - x0) * (right - left)

        def ty(v: float, y0: float = yfun(y0), y1: float = yfun(y1), y_top: float = y_top,
               y_bot: float = y_bot, f: Any = yfun) -> float:
            return y_bot - (f(v) - y0) / (y1 - y0) * (y_bot - y_top)

        for v, text in zip(yticks, labels):
            canvas.line([(left, ty(v)), (right, ty(v))], _GRID, 1)
            canvas.line([(left - 5, ty(v)), (left, ty(v))], _AXIS, 1)
            canvas.text(left - 8, ty(v), text, tick_px, anchor="rm")
        for v in xticks:
            canvas.line([(tx(v), y_top), (tx(v), y_bot)], _GRID, 1)
            canvas.line([(tx(v), y_bot), (tx(v), y_bot + 5)], _AXIS, 1)
            canvas.text(tx(v), y_bot + 8, _tick_label(v, 1.0), tick_px, anchor="mt")
        canvas.rect(left, y_top, right, y_bot, outline=_AXIS)
        canvas.text((left + right) / 2, y_bot + 28, "epoch", 13, anchor="mt")
        axis_name = panel_title + (" (log scale)" if log_y else "")
        canvas.text(x_off + 16, (y_top + y_bot) / 2, axis_name, 13, anchor="mm", angle=90)

        for _label, colour, dash, name, key in entries_per_panel[p_i]:
            pts = data[(name, key)]
            scr = [(tx(x), ty(y)) for x, y in pts]
            canvas.line(scr, colour, 2.2, dash)
            if len(pts) <= 40 or len(pts) == 1:
                for x, y in scr:
                    canvas.dot(x, y, 2.6, colour)
            if key.startswith("val_") and pts:  # ring on the best epoch (value in the legend)
                best = (max if "acc" in key else min)(pts, key=lambda p: p[1])
                bx, by = tx(best[0]), ty(best[1])
                canvas.dot(bx, by, 6, colour)
                canvas.dot(bx, by, 3.6, _BG)

        # legend under the panel
        lx, ly = left, y_bot + 52
        for label, colour, dash, *_ in entries_per_panel[p_i]:
            w = 34 + canvas.text_size(label, legend_px)[0] + 18
            if lx + w > x_off + panel_w - 16 and lx > left:
                lx, ly = left, ly + 22
            canvas.line([(lx, ly + 8), (lx + 28, ly + 8)], colour, 2.2, dash)
            canvas.text(lx + 34, ly + 8, label, legend_px, anchor="lm")
            lx += w
    return _save(canvas.finish(), path)


# ---- confusion matrix ----------------------------------------------------------------------------
def plot_confusion(
    cm: Any,
    classes: Sequence[str],
    path: PathLike,
    title: str = "Confusion matrix",
    max_label_chars: int = 28,
) -> Path:
    """Heat map of a confusion matrix (rows = true class, columns = predicted), coloured by the fraction
    of each true class (so rare classes are as visible as common ones), with the count in each non-empty
    cell. Cells, fonts and labels shrink with the number of classes (legible up to about 40); names
    longer than ``max_label_chars`` are shortened with "...", and column names are turned vertical when
    they do not fit across a cell.
    """
    m = np.asarray(cm)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"plot_confusion: cm must be square (C, C), got shape {m.shape}")
    c = m.shape[0]
    if len(classes) != c:
        raise ValueError(f"plot_confusion: {len(classes)} class names for a {c}x{c} matrix")
    if c == 0:
        raise ValueError("plot_confusion: empty confusion matrix")
    m = m.astype(np.int64)
    rows = m.sum(axis=1, keepdims=True)
    frac = np.divide(m, rows, out=np.zeros(m.shape, dtype=np.float64), where=rows > 0)

    cell = int(min(88, max(16, 760 // c)))
    label_px = float(min(15, max(9, cell * 0.5)))
    digits = len(str(int(m.max()))) if m.size else 1
    count_px = min(18.0, cell * 0.42, cell * 0.85 / (0.62 * digits))
    show_counts = count_px >= 6.5
    names = [_ellipsize(str(n), max_label_chars) for n in classes]
    probe = _Canvas(8, 8)
    name_w = max(probe.text_size(n, label_px)[0] for n in names)
    name_h = probe.text_size("Ag", label_px)[1]
    # Column names: across the cell when they fit, else at 45 degrees (few classes) or vertical (many).
    angle = 0 if name_w <= cell - 4 else (45 if c <= 12 else 90)
    x_label_h = {0: name_h, 45: (name_w + name_h) * 0.7072, 90: name_w}[angle] + 10

    left = 40 + name_w + 12
    top = 64
    grid = cell * c
    bar_w = 16
    width = int(left + grid + 30 + bar_w + 48)
    height = int(top + grid + x_label_h + 44)
    width = max(width, int(probe.text_size(title, 18)[0]) + 40)
    canvas = _Canvas(width, height)
    title_x = min(max(left + grid / 2, probe.text_size(title, 18)[0] / 2 + 10),
                  width - probe.text_size(title, 18)[0] / 2 - 10)
    canvas.text(title_x, 14, title, 18, anchor="mt")
    subtitle = f"{int(m.sum())} images, {c} classes; colour = fraction of the true class"
    canvas.text(left + grid / 2, top - 8, subtitle, 11, fill=_AXIS, anchor="mb")

    colours = BLUES_LUT[np.clip((frac * 255).round(), 0, 255).astype(np.int64)]
    for i in range(c):
        for j in range(c):
            x, y = left + j * cell, top + i * cell
            canvas.rect(x, y, x + cell, y + cell, fill=tuple(int(v) for v in colours[i, j]))
            if show_counts and m[i, j]:
                ink = (255, 255, 255) if frac[i, j] > 0.55 else _FG
                canvas.text(x + cell / 2, y + cell / 2, str(int(m[i, j])), count_px, fill=ink, anchor="mm")
    for k in range(c + 1):  # thin white grid, then a frame
        canvas.line([(left + k * cell, top), (left + k * cell, top + grid)], (255, 255, 255), 0.6)
        canvas.line([(left, top + k * cell), (left + grid, top + k * cell)], (255, 255, 255), 0.6)
    canvas.rect(left, top, left + grid, top + grid, outline=_AXIS)
    for i in range(c):  # diagonal outline: where the correct predictions are
        canvas.rect(left + i * cell, top + i * cell, left + (i + 1) * cell, top + (i + 1) * cell,
                    outline=(60, 60, 60), width=0.8)

    for i, name in enumerate(names):
        canvas.text(left - 8, top + i * cell + cell / 2, name, label_px, anchor="rm")
        cx = left + i * cell + cell / 2
        if angle == 45:  # the name ends under its column and runs down to the left
            canvas.text(cx + name_h * 0.35, top + grid + 6, name, label_px, anchor="rt", angle=45)
        else:
            canvas.text(cx, top + grid + 8, name, label_px, anchor="mt", angle=angle)
    canvas.text(left + grid / 2, top + grid + x_label_h + 10, "predicted class", 14, anchor="mt")
    canvas.text(14, top + grid / 2, "true class", 14, anchor="mm", angle=90)

    bx = left + grid + 30  # colour bar 0..1
    steps = max(2, int(grid))
    for k in range(steps):
        v = 1 - k / steps
        colour = tuple(int(x) for x in BLUES_LUT[int(round(v * 255))])
        canvas.rect(bx, top + k * grid / steps, bx + bar_w, top + (k + 1) * grid / steps + 0.5, fill=colour)
    canvas.rect(bx, top, bx + bar_w, top + grid, outline=_AXIS)
    for v in (0.0, 0.5, 1.0):
        y = top + (1 - v) * grid
        canvas.line([(bx + bar_w, y), (bx + bar_w + 4, y)], _AXIS, 1)
        canvas.text(bx + bar_w + 6, y, f"{v:.1f}", 11, anchor="lm")
    return _save(canvas.finish(), path)


# ---- image grids ---------------------------------------------------------------------------------
def _as_uint8_images(name: str, images: Any) -> np.ndarray:
    arr = np.asarray(images)
    if arr.ndim == 3:  # (N, H, W) greyscale
        arr = np.repeat(arr[..., None], 3, axis=-1)
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3):
        raise ValueError(f"{name} must be uint8 (N, H, W, 3) images, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        raise ValueError(f"{name} must be uint8 (0..255), got dtype {arr.dtype}")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return arr


def contact_sheet(
    images: Any,
    captions: Sequence[str],
    path: PathLike,
    cols: int = 8,
    scale: int = 2,
    title: str = "Hardest misclassified images (true -> predicted (probability))",
) -> Path:
    """A grid of images, each enlarged ``scale`` times (nearest neighbour: the pixels the model saw) with
    its caption wrapped below it (up to three lines). No images gives a sheet that says so."""
    arr = _as_uint8_images("images", images) if len(captions) or np.asarray(images).size else None
    n = 0 if arr is None else arr.shape[0]
    if n != len(captions):
        raise ValueError(f"contact_sheet: {n} images but {len(captions)} captions")
    if cols < 1 or scale < 1:
        raise ValueError(f"contact_sheet: cols and scale must be >= 1, got cols={cols}, scale={scale}")
    if n == 0:
        canvas = _Canvas(640, 140)
        canvas.text(320, 16, title, 16, anchor="mt")
        canvas.text(320, 80, "no misclassified images", 15, fill=_AXIS, anchor="mm")
        return _save(canvas.finish(), path)
    h, w = arr.shape[1] * scale, arr.shape[2] * scale
    tile_w = max(w, 96)
    cap_px = float(min(13, max(10, tile_w * 0.085)))
    probe = _Canvas(8, 8)
    wrapped = [_wrap(probe, str(c), cap_px, tile_w, 3) for c in captions]
    line_h = probe.text_size("Ag", cap_px)[1] + 1
    cap_h = line_h * max(len(lines) for lines in wrapped) + 6
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    gap, margin, top = 10, 14, 48
    width = int(max(margin * 2 + cols * tile_w + (cols - 1) * gap, probe.text_size(title, 16)[0] + 40))
    height = int(top + rows * (h + cap_h + gap) + margin)
    canvas = _Canvas(width, height)
    canvas.text(width / 2, 14, title, 16, anchor="mt")
    x_start = (width - (cols * tile_w + (cols - 1) * gap)) / 2
    for k in range(n):
        r, col = divmod(k, cols)
        x = x_start + col * (tile_w + gap)
        y = top + r * (h + cap_h + gap)
        ix = x + (tile_w - w) / 2
        canvas.paste(Image.fromarray(arr[k]).resize((w, h), Image.Resampling.NEAREST), round(ix), round(y))
        canvas.rect(round(ix) - 1, round(y) - 1, round(ix) + w + 1, round(y) + h + 1, outline=(200, 200, 200))
        for li, line in enumerate(wrapped[k]):
            canvas.text(x + tile_w / 2, y + h + 4 + li * line_h, line, cap_px, anchor="mt")
    return _save(canvas.finish(), path)


def _select_channels(maps: np.ndarray, max_channels: int) -> np.ndarray:
    """The ``max_channels`` channels that vary most over the given images (dead ReLU channels, all
    zero, would only show black squares), in channel order."""
    c = maps.shape[-1]
    if c <= max_channels:
        return np.arange(c)
    spread = maps.reshape(-1, c).std(axis=0)
    chosen = np.argsort(-spread, kind="stable")[:max_channels]
    return np.sort(chosen)


def feature_map_grid(
    maps: Any,
    path: PathLike,
    max_channels: int = 16,
    images: Any | None = None,
    labels: Sequence[str] | None = None,
    title: str = "First convolution feature maps",
    cell: int = 72,
) -> Path:
    """Feature maps (N, H, W, C) of a few images: one row per image, one column per channel (the
    ``max_channels`` most varying channels when there are more), each map min-max normalised on its
    own and drawn with the viridis colour map. ``images`` (uint8 (N, h, w, 3)), when given, are shown at
    the left of each row; ``labels`` (one per image) are written above each row's source image."""
    fm = np.asarray(maps, dtype=np.float64)
    if fm.ndim != 4:
        raise ValueError(f"feature_map_grid: maps must be (N, H, W, C), got shape {fm.shape}")
    if not np.all(np.isfinite(fm)):
        raise ValueError("feature_map_grid: maps contain NaN or infinite values")
    n, mh, mw, _ = fm.shape
    if n == 0:
        raise ValueError("feature_map_grid: no feature maps given")
    if max_channels < 1:
        raise ValueError(f"feature_map_grid: max_channels must be >= 1, got {max_channels}")
    src = None
    if images is not None:
        src = _as_uint8_images("images", images)
        if src.shape[0] != n:
            raise ValueError(f"feature_map_grid: {src.shape[0]} images for {n} feature maps")
    if labels is not None and len(labels) != n:
        raise ValueError(f"feature_map_grid: {len(labels)} labels for {n} images")
    chans = _select_channels(fm, int(max_channels))
    cw = cell
    ch = max(8, round(cell * mh / mw))
    gap, left, top = 4, 16, 74
    label_h = 16 if labels is not None else 0
    ncols = len(chans) + (1 if src is not None else 0)
    extra = 12 if src is not None else 0
    probe = _Canvas(8, 8)
    width = int(max(left * 2 + ncols * cw + (ncols - 1) * gap + extra, probe.text_size(title, 16)[0] + 40))
    height = int(top + n * (ch + gap + label_h) + 24)
    canvas = _Canvas(width, height)
    canvas.text(width / 2, 12, title, 16, anchor="mt")
    canvas.text(width / 2, 34, f"{len(chans)} of {fm.shape[-1]} channels, each scaled to its own min..max",
                11, fill=_AXIS, anchor="mt")
    x0 = left
    if src is not None:
        canvas.text(x0 + cw / 2, top - 4, "image", 11, anchor="mb")
        x0 += cw + gap + extra
    for j, c in enumerate(chans):
        canvas.text(x0 + j * (cw + gap) + cw / 2, top - 4, f"ch {int(c)}", 11, anchor="mb")
    for i in range(n):
        y = top + label_h + i * (ch + gap + label_h)
        if labels is not None:
            canvas.text(left, y - 2, _ellipsize(str(labels[i]), 60), 11, anchor="lb")
        if src is not None:
            canvas.paste(Image.fromarray(src[i]).resize((cw, ch), Image.Resampling.BILINEAR), left, round(y))
        for j, c in enumerate(chans):
            fmap = fm[i, :, :, c]
            lo, hi = fmap.min(), fmap.max()
            norm = (fmap - lo) / (hi - lo) if hi > lo else np.zeros_like(fmap)
            rgb = VIRIDIS_LUT[np.clip((norm * 255).round(), 0, 255).astype(np.int64)]
            tile = Image.fromarray(rgb).resize((cw, ch), Image.Resampling.NEAREST)
            canvas.paste(tile, x0 + j * (cw + gap), round(y))
    return _save(canvas.finish(), path)
