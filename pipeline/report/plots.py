"""Figures for a run directory, drawn with matplotlib's Agg renderer.

- :func:`plot_curves`: per-epoch losses and accuracies, one or several runs (e.g. distilled vs scratch).
- :func:`plot_confusion`: confusion-matrix heat map with counts, class names on both axes, a colour bar.
- :func:`contact_sheet`: a grid of images with captions (the hardest misclassified test images).
- :func:`feature_map_grid`: first-convolution feature maps of a few images, one image per row.

Each ``plot_*`` function has a ``*_figure`` twin that returns the :class:`matplotlib.figure.Figure`
without writing it, so tests can read its texts and lines. Figures are built from ``Figure`` objects
and saved through an explicit ``FigureCanvasAgg``: pyplot is never imported, so drawing a run's figures
never switches the caller's backend or opens a window. matplotlib is imported inside the functions, so
``leaflens --help`` and serving do not pay for its import. Every figure is drawn under matplotlib's
default style (a user's matplotlibrc or style sheet does not restyle it; the caller's settings are
restored afterwards) at :data:`DPI` dots per inch, with a size in pixels computed from the inputs alone,
so the same inputs give a PNG of the same size. Images (contact sheet, feature maps) are placed pixel
for pixel with ``figimage`` (enlarged by whole-pixel repetition: the pixels the model saw). Every PNG is
written atomically (:mod:`leaflens.files`: a temporary file beside the target, then ``os.replace``) and
its path returned.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from leaflens.files import write_path_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import LayoutEngine

PathLike = str | os.PathLike[str]

#: Dots per inch of every figure: sizes are chosen in pixels and divided by it.
DPI = 100
#: Line colours by position: matplotlib's "tab10" qualitative colour map (distinct, colour-blind-tolerant).
PALETTE_CMAP = "tab10"
#: Confusion-matrix cells, shaded by the fraction of the true class.
CONFUSION_CMAP = "Blues"
#: Feature maps, each scaled to its own min..max (perceptually uniform, readable in grey).
FEATURE_CMAP = "viridis"
_LINESTYLES = ("-", "--", ":", "-.")  # the metric's line style when colours name the runs
_TEXT = "#222222"
_MUTED = "#5a5a5a"
_GRID = "#e2e2e2"


# ---- shared helpers ------------------------------------------------------------------------------------
# Fonts tried after DejaVu Sans for characters it lacks (matplotlib falls back glyph by glyph), so class names
# in Chinese, Japanese or Korean are drawn where the system has such a font: Linux (Noto, WenQuanYi,
# Droid), Windows (Microsoft YaHei, SimHei), macOS (PingFang, Hiragino, Arial Unicode).
FALLBACK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Zen Hei",
                  "WenQuanYi Micro Hei", "Droid Sans Fallback", "Microsoft YaHei", "SimHei", "PingFang SC",
                  "Hiragino Sans GB", "Arial Unicode MS")


@functools.lru_cache(maxsize=1)
def _font_families() -> tuple[str, ...]:
    """DejaVu Sans, then the installed fonts of :data:`FALLBACK_FONTS`."""
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    return ("DejaVu Sans", *(f for f in FALLBACK_FONTS if f in installed))


@functools.lru_cache(maxsize=4096)
def _has_glyph(char: str) -> bool:
    """Whether one of :func:`_font_families` draws ``char`` (no empty box)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    for family in _font_families():
        path = font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
        if FT2Font(path).get_char_index(ord(char)):
            return True
    return False


def drawable(text: str) -> bool:
    """Whether every character of ``text`` can be drawn with the fonts on this machine."""
    return all(ch.isspace() or _has_glyph(ch) for ch in text)


def class_labels(classes: Sequence[str]) -> list[str]:
    """The class names as drawn: a name this machine has no font for (e.g. Chinese without a CJK font) becomes
    "class <i>", its place in the class order (report.md's tables), rather than a row of empty boxes."""
    return [str(name) if drawable(str(name)) else f"class {i}" for i, name in enumerate(classes)]


@contextlib.contextmanager
def _default_style() -> Iterator[None]:
    """matplotlib's default style for the duration of a figure's build and save, so that a user's style
    sheet cannot restyle (or resize the text of) a run's figures; the caller's rcParams are restored. The
    sans-serif font list gains the installed :data:`FALLBACK_FONTS`."""
    import matplotlib
    import matplotlib.style

    with matplotlib.style.context("default"), matplotlib.rc_context({"font.sans-serif": list(_font_families())}):
        yield


def _new_figure(width_px: float, height_px: float, layout: LayoutEngine | None = None) -> Figure:
    """A white figure of ``width_px`` x ``height_px`` pixels at :data:`DPI`, on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(int(width_px) / DPI, int(height_px) / DPI), dpi=DPI, facecolor="white", layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _pt(px: float) -> float:
    """A font size in points for text ``px`` pixels tall at :data:`DPI`."""
    return px * 72.0 / DPI


@functools.lru_cache(maxsize=4096)
def _text_size(text: str, px: float) -> tuple[float, float]:
    """Width and height in pixels of ``text`` in the default sans-serif font at ``px`` pixels, measured
    by the Agg renderer that draws it (to lay out class names and captions before drawing)."""
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    with _default_style():
        width, height, _descent = RendererAgg(1, 1, DPI).get_text_width_height_descent(
            text or " ", FontProperties(size=_pt(px)), ismath=False)
    return float(width), float(height)


def _pixel_text(fig: Figure, x: float, y: float, text: str, px: float, ha: str = "center", va: str = "top",
                colour: str = _TEXT, **kwargs: Any) -> None:
    """``text`` at pixel (``x``, ``y``) measured from the figure's TOP-left corner."""
    fig.text(x / fig.bbox.width, 1 - y / fig.bbox.height, text, fontsize=_pt(px), ha=ha, va=va, color=colour,
             **kwargs)


def _save(fig: Figure, path: PathLike) -> Path:
    """Write ``fig`` as an RGB PNG atomically (:func:`leaflens.files.write_path_atomic`: a temporary file
    in the same folder, then ``os.replace``)."""

    def render(tmp: Path) -> None:
        from PIL import Image

        with _default_style():
            fig.canvas.draw()
            rgba = np.asarray(fig.canvas.buffer_rgba())  # type: ignore[attr-defined]  # _new_figure's Agg canvas
        Image.fromarray(rgba[..., :3]).save(tmp, format="PNG")  # opaque figures: RGB, no alpha channel

    return write_path_atomic(path, render)


def _ellipsize(text: str, max_chars: int) -> str:
    """Shorten ``text`` to ``max_chars`` by cutting its middle ("Tomato___Sep...variant_3"): class names
    that share a long prefix stay distinguishable by their ends."""
    if len(text) <= max_chars:
        return text
    keep = max(2, max_chars - 3)
    head = (keep + 1) // 2
    return text[:head] + "..." + text[len(text) - (keep - head):]


def _wrap(text: str, px: float, width: float, max_lines: int) -> list[str]:
    """Greedy word wrap into at most ``max_lines`` lines of ``width`` pixels (the last one ellipsized)."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        trial = f"{current} {word}".strip()
        if current and _text_size(trial, px)[0] > width:
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
        while len(line) > 4 and _text_size(line, px)[0] > width:
            line = line[:-4] + "..."
        lines[i] = line
    return lines


def _resize_nearest(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``image`` (H, W, ...) resampled to ``height`` x ``width`` by nearest neighbour (no blur)."""
    rows = np.arange(height) * image.shape[0] // height
    cols = np.arange(width) * image.shape[1] // width
    return image[rows][:, cols]


def _paste(canvas: np.ndarray, tile: np.ndarray, x: int, y: int) -> None:
    canvas[y:y + tile.shape[0], x:x + tile.shape[1]] = tile


def _show_pixels(fig: Figure, sheet: np.ndarray) -> None:
    """Put the uint8 RGB ``sheet`` (the figure's size) under the figure's texts, pixel for pixel. Opaque
    RGBA is what Agg composites without converting: half the drawing time of a large sheet."""
    alpha = np.full(sheet.shape[:2] + (1,), 255, np.uint8)
    fig.figimage(np.concatenate([sheet, alpha], axis=-1), 0, 0, origin="upper")


# ---- training curves -----------------------------------------------------------------------------------
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


def _best(key: str, pts: list[tuple[float, float]]) -> tuple[float, float]:
    """The best epoch of a validation metric: the highest accuracy, the lowest loss (earliest on ties)."""
    return (max if "acc" in key else min)(pts, key=lambda p: p[1])


def _round_limits(lo: float, hi: float, nbins: int, integer: bool = False) -> tuple[float, float]:
    """[lo, hi] widened to the nearest round tick values (steps of 1, 2, 2.5 or 5 times a power of ten),
    so that an axis starts and ends on a labelled tick."""
    from matplotlib.ticker import MaxNLocator

    ticks = MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10], integer=integer).tick_values(lo, hi)
    return float(max([t for t in ticks if t <= lo], default=lo)), float(min([t for t in ticks if t >= hi], default=hi))


def _set_axes_limits(ax: Axes, xs: list[float], ys: list[float], log_y: bool) -> None:
    """Round x limits (whole epochs); a log y axis with readable labels (0.05, 0.1, 1, 10), or a linear
    one on round numbers that does not go below 0 for non-negative metrics nor above 1 for fractions."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10], integer=True))
    if min(xs) == max(xs):
        ax.set_xlim(min(xs) - 1, max(xs) + 1)
    else:
        ax.set_xlim(*_round_limits(min(xs), max(xs), nbins=8, integer=True))
    if log_y:
        ax.set_yscale("log")
        decades = math.log10(max(ys)) - math.log10(min(ys))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 4 else (1.0,)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.margins(y=0.04)
        return
    span = max(ys) - min(ys) or abs(max(ys)) * 0.1 or 0.1
    lo, hi = min(ys) - 0.04 * span, max(ys) + 0.04 * span
    if min(ys) >= 0:  # losses and accuracies: no negative axis, and fractions stop at 1
        lo = max(0.0, lo)
        if max(ys) <= 1 and max(ys) > min(ys):
            hi = min(1.0, hi)
    ax.set_ylim(*_round_limits(lo, hi, nbins=6))


def curves_figure(
    history: Sequence[Mapping[str, Any]] | None,
    keys_left: Sequence[str] = ("train_loss", "val_loss"),
    keys_right: Sequence[str] = ("train_acc", "val_acc"),
    title: str = "Training curves",
    series: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    panel_titles: tuple[str, str] = ("loss", "accuracy"),
    width: int = 1200,
    log_scale: str = "auto",
) -> Figure:
    """The figure :func:`plot_curves` writes (see there for the arguments)."""
    from matplotlib import colormaps
    from matplotlib.layout_engine import ConstrainedLayoutEngine

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

    palette = colormaps[PALETTE_CMAP].colors  # type: ignore[attr-defined]  # a ListedColormap
    multi = len(series) > 1 or any(name for name in series)
    # One legend column per metric (at most two): with several runs each column lists one metric's runs.
    panel_entries = []
    for _, keys in panels:
        entries = []
        for k_i, key in enumerate(keys):
            for s_i, name in enumerate(series):
                pts = _series_values(series[name], key)
                if not pts:  # nothing recorded: no line, no legend entry
                    continue
                label = f"{name}: {key}" if multi else key
                if key.startswith("val_"):
                    best = _best(key, pts)
                    value = f"{best[1]:.3f}" if "acc" in key else f"{best[1]:.4g}"
                    label += f" (best {value} @ {best[0]:g})"
                colour = palette[(s_i if multi else k_i) % len(palette)]
                style = _LINESTYLES[k_i % len(_LINESTYLES)] if multi else "-"
                entries.append((label, colour, style, key, pts))
        panel_entries.append(entries)
    legend_cols = [max(1, min(2, len(keys))) for _, keys in panels]
    legend_rows = max(math.ceil(len(e) / c) for e, c in zip(panel_entries, legend_cols))
    height = 470 + 22 * max(1, legend_rows)

    with _default_style():
        fig = _new_figure(width, height, ConstrainedLayoutEngine(w_pad=12 / DPI, h_pad=8 / DPI, wspace=0.06))
        fig.suptitle(title, fontsize=_pt(21), color=_TEXT)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (panel_title, keys), entries, ncol in zip(axes, panels, panel_entries, legend_cols):
            ax.set_title(panel_title, fontsize=_pt(16), color=_TEXT)
            if not entries:
                ax.text(0.5, 0.5, "no data recorded for " + ", ".join(keys), transform=ax.transAxes,
                        ha="center", va="center", fontsize=_pt(14), color=_MUTED)
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            ax.grid(True, color=_GRID, linewidth=0.8)
            ax.set_axisbelow(True)
            ax.tick_params(labelsize=_pt(13))
            xs = [p[0] for e in entries for p in e[4]]
            ys = [p[1] for e in entries for p in e[4]]
            log_y = log_scale == "on" or (log_scale == "auto" and min(ys) > 0 and max(ys) / min(ys) > 30)
            if log_y and min(ys) <= 0:
                raise ValueError("plot_curves: a log scale needs positive values")
            ax.set_xlabel("epoch", fontsize=_pt(14))
            ax.set_ylabel(panel_title + (" (log scale)" if log_y else ""), fontsize=_pt(14))
            for label, colour, style, key, pts in entries:
                px, py = zip(*pts)
                ax.plot(px, py, color=colour, linestyle=style, linewidth=2.2, label=label,
                        marker="o" if len(pts) <= 40 else None, markersize=3.5, clip_on=False)
                if key.startswith("val_"):  # ring on the best epoch (its value is in the legend)
                    bx, by = _best(key, pts)
                    ax.plot([bx], [by], marker="o", markersize=10, markerfacecolor="white",
                            markeredgecolor=colour, markeredgewidth=2.2, linestyle="none", zorder=5,
                            clip_on=False)
            _set_axes_limits(ax, xs, ys, log_y)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=ncol, frameon=False,
                      fontsize=_pt(13), handlelength=2.6, columnspacing=1.6)
    return fig


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
    (an empty key list drops that panel), ``width`` pixels wide. The x axis is each row's ``epoch`` (else
    its position, from 1); missing, None or non-finite values are skipped, so rows may carry different keys.

    ``series`` maps a run name to its history to compare runs (e.g. {"distilled": h1, "scratch": h2}):
    then the colour names the run and the line style the metric; with one run the colour names the metric.
    ``history`` is used when ``series`` is None. Best values are marked on keys starting with "val_"
    (the highest accuracy, the lowest loss) and written in the legend. ``log_scale`` ("auto", "on",
    "off"): "auto" draws a panel's y axis on a log scale when its positive values span more than a factor
    of 30, so that a summed distillation loss does not flatten a cross-entropy curve drawn beside it.
    """
    fig = curves_figure(history, keys_left, keys_right, title, series, panel_titles, width, log_scale)
    return _save(fig, path)


# ---- confusion matrix ----------------------------------------------------------------------------------
def confusion_figure(cm: Any, classes: Sequence[str], title: str = "Confusion matrix",
                     max_label_chars: int = 28) -> Figure:
    """The figure :func:`plot_confusion` writes (see there for the arguments)."""
    from matplotlib.patches import Rectangle

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

    # Pixel layout: cells, fonts and labels shrink with the number of classes.
    cell = int(min(88, max(16, 760 // c)))
    label_px = float(min(15, max(9, cell * 0.5)))
    digits = len(str(int(m.max())))
    count_px = min(18.0, cell * 0.42, cell * 0.85 / (0.62 * digits))
    names = [_ellipsize(n, max_label_chars) for n in class_labels(classes)]
    name_w = max(_text_size(n, label_px)[0] for n in names)
    name_h = _text_size("Ag", label_px)[1]
    # Column names: across the cell when they fit, else at 45 degrees (few classes) or vertical (many).
    angle = 0 if name_w <= cell - 4 else (45 if c <= 12 else 90)
    x_label_h = {0: name_h, 45: (name_w + name_h) * 0.7072, 90: name_w}[angle] + 10
    grid = cell * c
    left, top = 34 + name_w + 14, 70
    bar_x, bar_w = left + grid + 24, 16
    title_w = _text_size(title, 19)[0]
    width = int(max(bar_x + bar_w + 72, title_w + 40))
    height = int(top + grid + x_label_h + 48)

    with _default_style():
        fig = _new_figure(width, height)
        W, H = fig.bbox.width, fig.bbox.height
        ax = fig.add_axes((left / W, 1 - (top + grid) / H, grid / W, grid / H))
        image = ax.imshow(frac, cmap=CONFUSION_CMAP, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
        if count_px >= 6.5:
            for i, j in zip(*np.nonzero(m)):
                ink = "white" if frac[i, j] > 0.55 else _TEXT
                ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=_pt(count_px), color=ink)
        ax.set_xticks(np.arange(c), labels=names, fontsize=_pt(label_px))
        ax.set_yticks(np.arange(c), labels=names, fontsize=_pt(label_px))
        if angle:
            ax.tick_params(axis="x", labelrotation=angle)
            for text in ax.get_xticklabels():  # the name ends under its column
                text.set(ha="right" if angle == 45 else "center", rotation_mode="anchor" if angle == 45 else None)
        edges = np.arange(c + 1) - 0.5  # thin white lines between the cells
        ax.vlines(edges, -0.5, c - 0.5, colors="white", linewidth=0.6)
        ax.hlines(edges, -0.5, c - 0.5, colors="white", linewidth=0.6)
        ax.tick_params(length=3, color=_MUTED)
        for i in range(c):  # diagonal outline: where the correct predictions are
            ax.add_patch(Rectangle((i - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#3c3c3c", linewidth=0.8))
        ax.set_xlabel("predicted class", fontsize=_pt(14), labelpad=8)
        ax.set_ylabel("true class", fontsize=_pt(14), labelpad=8)

        title_x = min(max(left + grid / 2, title_w / 2 + 10), width - title_w / 2 - 10)
        _pixel_text(fig, title_x, 14, title, 19)
        subtitle = f"{int(m.sum())} images, {c} classes; colour = fraction of the true class"
        _pixel_text(fig, left + grid / 2, top - 10, subtitle, 11, va="bottom", colour=_MUTED)
        cax = fig.add_axes((bar_x / W, 1 - (top + grid) / H, bar_w / W, grid / H))
        bar = fig.colorbar(image, cax=cax, ticks=[0.0, 0.25, 0.5, 0.75, 1.0])
        bar.ax.tick_params(labelsize=_pt(11))
        bar.set_label("fraction of the true class", fontsize=_pt(12))
    return fig


def plot_confusion(
    cm: Any,
    classes: Sequence[str],
    path: PathLike,
    title: str = "Confusion matrix",
    max_label_chars: int = 28,
) -> Path:
    """Heat map of a confusion matrix (rows = true class, columns = predicted), coloured by the fraction
    of each true class (so rare classes are as visible as common ones), with the count in each non-empty
    cell and a colour bar. Cells, fonts and labels shrink with the number of classes (legible up to
    about 40); names longer than ``max_label_chars`` are shortened in the middle with "...", and column
    names are turned (45 degrees, or vertical for many classes) when they do not fit across a cell.
    """
    return _save(confusion_figure(cm, classes, title, max_label_chars), path)


# ---- image grids ---------------------------------------------------------------------------------------
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


def contact_sheet_figure(
    images: Any,
    captions: Sequence[str],
    cols: int = 8,
    scale: int = 2,
    title: str = "Hardest misclassified images (true -> predicted (probability))",
) -> Figure:
    """The figure :func:`contact_sheet` writes (see there for the arguments)."""
    arr = _as_uint8_images("images", images) if len(captions) or np.asarray(images).size else None
    n = 0 if arr is None else arr.shape[0]
    if n != len(captions):
        raise ValueError(f"contact_sheet: {n} images but {len(captions)} captions")
    if cols < 1 or scale < 1:
        raise ValueError(f"contact_sheet: cols and scale must be >= 1, got cols={cols}, scale={scale}")
    with _default_style():
        if arr is None or n == 0:
            fig = _new_figure(640, 140)
            _pixel_text(fig, 320, 16, title, 16)
            _pixel_text(fig, 320, 80, "no misclassified images", 15, va="center", colour=_MUTED)
            return fig
        h, w = arr.shape[1] * scale, arr.shape[2] * scale
        tile_w = max(w, 96)
        cap_px = float(min(13, max(10, tile_w * 0.085)))
        wrapped = [_wrap(str(c), cap_px, tile_w, 3) for c in captions]
        line_h = _text_size("Ag", cap_px)[1] + 3
        cap_h = math.ceil(line_h * max(len(lines) for lines in wrapped)) + 6
        cols = min(cols, n)
        rows = math.ceil(n / cols)
        gap, margin, top = 10, 14, 48
        width = int(max(margin * 2 + cols * tile_w + (cols - 1) * gap, _text_size(title, 16)[0] + 40))
        height = int(top + rows * (h + cap_h + gap) + margin)
        sheet = np.full((height, width, 3), 255, np.uint8)
        x_start = (width - (cols * tile_w + (cols - 1) * gap)) // 2
        places = []
        for k in range(n):
            r, col = divmod(k, cols)
            x = x_start + col * (tile_w + gap) + (tile_w - w) // 2
            y = top + r * (h + cap_h + gap)
            sheet[y - 1:y + h + 1, x - 1:x + w + 1] = 200  # a thin grey frame
            _paste(sheet, np.repeat(np.repeat(arr[k], scale, axis=0), scale, axis=1), x, y)
            places.append((x + w / 2, y + h))
        fig = _new_figure(width, height)
        _show_pixels(fig, sheet)
        _pixel_text(fig, width / 2, 14, title, 16)
        for (cx, bottom), lines in zip(places, wrapped):
            _pixel_text(fig, cx, bottom + 4, "\n".join(lines), cap_px, linespacing=1.25)
    return fig


def contact_sheet(
    images: Any,
    captions: Sequence[str],
    path: PathLike,
    cols: int = 8,
    scale: int = 2,
    title: str = "Hardest misclassified images (true -> predicted (probability))",
) -> Path:
    """A grid of images, each enlarged ``scale`` times (whole-pixel repetition: the pixels the model saw)
    with its caption wrapped below it (up to three lines). No images gives a sheet that says so."""
    return _save(contact_sheet_figure(images, captions, cols, scale, title), path)


def _select_channels(maps: np.ndarray, max_channels: int) -> np.ndarray:
    """The ``max_channels`` channels that vary most over the given images (dead ReLU channels, all
    zero, would only show flat squares), in channel order."""
    c = maps.shape[-1]
    if c <= max_channels:
        return np.arange(c)
    spread = maps.reshape(-1, c).std(axis=0)
    chosen = np.argsort(-spread, kind="stable")[:max_channels]
    return np.sort(chosen)


def feature_map_figure(
    maps: Any,
    max_channels: int = 16,
    images: Any | None = None,
    labels: Sequence[str] | None = None,
    title: str = "First convolution feature maps",
    cell: int = 72,
) -> Figure:
    """The figure :func:`feature_map_grid` writes (see there for the arguments)."""
    from matplotlib import colormaps

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
    cw, ch = cell, max(8, round(cell * mh / mw))
    gap, left, top = 4, 16, 78
    label_h = 16 if labels is not None else 0
    ncols = len(chans) + (1 if src is not None else 0)
    extra = 12 if src is not None else 0
    with _default_style():
        width = int(max(left * 2 + ncols * cw + (ncols - 1) * gap + extra, _text_size(title, 16)[0] + 40))
        height = int(top + n * (ch + gap + label_h) + 24)
        sheet = np.full((height, width, 3), 255, np.uint8)
        colour_map = colormaps[FEATURE_CMAP]
        x0 = left + (cw + gap + extra if src is not None else 0)
        for i in range(n):
            y = top + label_h + i * (ch + gap + label_h)
            if src is not None:
                _paste(sheet, _resize_nearest(src[i], ch, cw), left, y)
            for j, c in enumerate(chans):
                fmap = fm[i, :, :, c]
                lo, hi = fmap.min(), fmap.max()
                norm = (fmap - lo) / (hi - lo) if hi > lo else np.zeros_like(fmap)
                rgb = colour_map(norm, bytes=True)[..., :3]
                _paste(sheet, _resize_nearest(rgb, ch, cw), x0 + j * (cw + gap), y)
        fig = _new_figure(width, height)
        _show_pixels(fig, sheet)
        _pixel_text(fig, width / 2, 12, title, 16)
        _pixel_text(fig, width / 2, 36, f"{len(chans)} of {fm.shape[-1]} channels, each scaled to its own "
                    "min..max (dark = min, yellow = max)", 11, colour=_MUTED)
        if src is not None:
            _pixel_text(fig, left + cw / 2, top - 4, "image", 11, va="bottom")
        for j, c in enumerate(chans):
            _pixel_text(fig, x0 + j * (cw + gap) + cw / 2, top - 4, f"ch {int(c)}", 11, va="bottom")
        if labels is not None:
            for i, label in enumerate(labels):
                y = top + label_h + i * (ch + gap + label_h)
                _pixel_text(fig, left, y - 2, _ellipsize(str(label), 60), 11, ha="left", va="bottom")
    return fig


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
    return _save(feature_map_figure(maps, max_channels, images, labels, title, cell), path)
