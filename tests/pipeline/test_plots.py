"""pipeline.report.plots: each figure is a PNG Pillow re-opens, of the expected size, with the content it claims
(the curve colours where the data is, the heat map's shades and counts, the class names, the pasted pixels, the
colour-map ends), the same whatever the caller's matplotlib settings, written atomically; matplotlib is loaded
only when a figure is drawn, and never through pyplot."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from matplotlib import colormaps
from matplotlib.colors import to_rgb
from PIL import Image

from leaflens.pipeline.report import plots

TAB10 = [tuple(round(255 * v) for v in to_rgb(c)) for c in colormaps[plots.PALETTE_CMAP].colors]


def load(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def near(img: np.ndarray, colour: tuple[int, ...], tol: int = 24) -> int:
    """Pixels within ``tol`` (max channel difference) of ``colour``."""
    return int((np.abs(img.astype(int) - np.array(colour)).max(axis=-1) <= tol).sum())


def cmap_rgb(name: str, value: float) -> tuple[int, ...]:
    return tuple(int(v) for v in colormaps[name](value, bytes=True)[:3])


def axes_pixels(fig, ax) -> tuple[slice, slice]:
    """Rows and columns of the PNG inside ``ax``'s frame (display y runs upwards, image rows downwards)."""
    fig.canvas.draw()
    box = ax.get_window_extent()
    height = fig.bbox.height
    return (slice(int(height - box.y1) + 2, int(height - box.y0) - 1), slice(int(box.x0) + 2, int(box.x1) - 1))


def cell_corner_colours(img: np.ndarray, fig, c: int) -> np.ndarray:
    """(C, C, 3): the PNG's colour near the top-left corner of each heat-map cell, away from its count."""
    rows, cols = axes_pixels(fig, fig.axes[0])
    cell_h, cell_w = (rows.stop - rows.start + 3) / c, (cols.stop - cols.start + 3) / c
    ys = (rows.start - 2 + (np.arange(c) + 0.25) * cell_h).astype(int)
    xs = (cols.start - 2 + (np.arange(c) + 0.25) * cell_w).astype(int)
    return img[ys][:, xs]


def history(n: int, speed: float = 1.0) -> list[dict]:
    return [{"epoch": e + 1, "train_loss": 2 * math.exp(-e / 8 * speed) + 0.1,
             "val_loss": 2 * math.exp(-e / 10 * speed) + 0.3, "train_acc": 1 - 0.6 * math.exp(-e / 6 * speed),
             "val_acc": 0.93 - 0.6 * math.exp(-e / 7 * speed), "lr": 1e-3} for e in range(n)]


# ---- curves ---------------------------------------------------------------------------------------------
def test_curves_png_has_both_metric_colours(tmp_path: Path) -> None:
    out = plots.plot_curves(history(25), tmp_path / "curves.png", title="run 1")
    assert out == tmp_path / "curves.png"
    img = load(out)
    assert img.shape[1] == 1200 and 450 < img.shape[0] < 700
    blue, orange = TAB10[0], TAB10[1]
    left, right = img[:, :600], img[:, 600:]
    for panel in (left, right):  # train (blue) and val (orange) curves drawn in both panels
        assert near(panel, blue) > 300 and near(panel, orange) > 300
    assert near(img, TAB10[2]) == 0  # no third series
    assert img.std() > 10
    again = load(plots.plot_curves(history(25), tmp_path / "again.png", title="run 1"))
    assert np.array_equal(img, again)  # same inputs, same pixels


def test_curves_draw_the_data_where_it_is_and_name_the_best_epoch() -> None:
    rows = history(25)
    fig = plots.curves_figure(rows, title="run 1")
    loss_ax, acc_ax = fig.axes
    assert fig.get_suptitle() == "run 1"
    assert [ax.get_title() for ax in fig.axes] == ["loss", "accuracy"]
    best = min(range(25), key=lambda e: rows[e]["val_loss"])
    labels = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert labels == ["train_loss", f"val_loss (best {rows[best]['val_loss']:.4g} @ {best + 1})"]
    line = next(ln for ln in acc_ax.get_lines() if ln.get_label() == "train_acc")
    assert np.allclose(line.get_xdata(), range(1, 26)) and np.allclose(line.get_ydata(), [r["train_acc"] for r in rows])
    ring = [ln for ln in acc_ax.get_lines() if ln.get_marker() == "o" and ln.get_markerfacecolor() == "white"]
    best_acc = max(range(25), key=lambda e: rows[e]["val_acc"])
    assert len(ring) == 1 and ring[0].get_xdata()[0] == best_acc + 1
    lo, hi = acc_ax.get_ylim()  # round limits holding the data, fractions never above 1
    assert lo <= min(r["train_acc"] for r in rows) and hi == 1.0 and loss_ax.get_ylim()[0] == 0.0
    assert acc_ax.get_xlim() == (0.0, 25.0)


def test_curves_compare_runs_by_colour(tmp_path: Path) -> None:
    runs = {"distilled": history(30, 1.3), "scratch": history(30), "kd": history(30, 2)}
    img = load(plots.plot_curves(None, tmp_path / "c.png", series=runs))
    for colour in TAB10[:3]:
        assert near(img, colour) > 300
    fig = plots.curves_figure(None, series=runs)
    styles = {ln.get_label(): (ln.get_linestyle(), ln.get_color()) for ln in fig.axes[0].get_lines()}
    kd_best = min(r["val_loss"] for r in runs["kd"])
    kd_epoch = next(r["epoch"] for r in runs["kd"] if r["val_loss"] == kd_best)
    assert styles["scratch: train_loss"][0] == "-" and styles[f"kd: val_loss (best {kd_best:.4g} @ {kd_epoch})"] \
        == ("--", colormaps[plots.PALETTE_CMAP].colors[2])  # colour = run, line style = metric
    with pytest.raises(ValueError, match="either history or series"):
        plots.plot_curves(history(3), tmp_path / "x.png", series={"a": history(3)})


def test_curves_skip_missing_values_and_draw_an_empty_panel(tmp_path: Path) -> None:
    rows = [{"epoch": 1, "train_loss": 1.0}, {"epoch": 2, "train_loss": None, "val_loss": float("nan")},
            {"epoch": 3, "train_loss": 0.5, "val_loss": 0.7}]
    img = load(plots.plot_curves(rows, tmp_path / "c.png"))  # no accuracies at all: right panel says so
    fig = plots.curves_figure(rows)
    loss, empty = (img[axes_pixels(fig, ax)] for ax in fig.axes)
    assert near(loss, TAB10[0]) > 50 and near(loss, TAB10[1]) > 20
    assert near(empty, TAB10[0]) == 0 and near(empty, TAB10[1]) == 0
    assert [t.get_text() for t in fig.axes[1].texts] == ["no data recorded for train_acc, val_acc"]
    one = load(plots.plot_curves([{"train_loss": 0.4, "val_loss": 0.5}], tmp_path / "one.png",
                                 keys_right=()))  # a single epoch, a single panel
    assert near(one, TAB10[0]) > 20 and near(one, TAB10[1]) > 20


def test_losses_of_different_sizes_get_a_log_axis(tmp_path: Path) -> None:
    """A summed distillation loss (~20) beside a CE loss (~0.05..1): on a linear axis the CE curve is
    squashed into a few pixels; the automatic log axis spreads it out, with plain-number tick labels."""
    rows = [{"epoch": e + 1, "train_loss": 20 - e, "val_loss": 1.0 / (e + 1) ** 1.3} for e in range(10)]

    def orange_rows(log_scale: str) -> tuple[int, str]:
        fig = plots.curves_figure(rows, keys_right=(), log_scale=log_scale)
        img = load(plots._save(fig, tmp_path / f"{log_scale}.png"))
        r, c = axes_pixels(fig, fig.axes[0])
        mask = np.abs(img[r, c].astype(int) - np.array(TAB10[1])).max(axis=-1) <= 24
        return int(mask.any(axis=1).sum()), fig.axes[0].get_yscale()  # rows of the plot area holding orange

    (auto, auto_scale), (flat, flat_scale) = orange_rows("auto"), orange_rows("off")
    assert (auto_scale, flat_scale) == ("log", "linear")
    assert auto > 150 > 60 > flat
    fig = plots.curves_figure(rows, keys_right=())
    fig.canvas.draw()
    ticks = {t.get_text() for t in fig.axes[0].get_yticklabels()}
    assert {"0.1", "1", "10"} <= ticks
    with pytest.raises(ValueError, match="log_scale"):
        plots.plot_curves(rows, tmp_path / "x.png", log_scale="yes")


# ---- confusion matrix -----------------------------------------------------------------------------------
def test_confusion_heat_map_shades_each_cell_by_its_fraction(tmp_path: Path) -> None:
    cm = np.array([[40, 0, 0], [3, 38, 2], [0, 1, 41]])
    names = ["angular_leaf_spot", "bean_rust", "healthy"]
    img = load(plots.plot_confusion(cm, names, tmp_path / "cm.png"))
    assert 300 < img.shape[1] < 900 and 300 < img.shape[0] < 900
    shades = cell_corner_colours(img, plots.confusion_figure(cm, names), 3)
    frac = cm / cm.sum(axis=1, keepdims=True)
    for i in range(3):
        for j in range(3):
            assert near(shades[i, j][None], cmap_rgb(plots.CONFUSION_CMAP, frac[i, j]), tol=3) == 1, (i, j)
    assert near(img, cmap_rgb(plots.CONFUSION_CMAP, 1.0), tol=6) > 1000  # row 0 is 100 % on the diagonal


def test_confusion_writes_counts_names_and_a_colour_bar() -> None:
    cm = np.array([[40, 0, 0], [3, 38, 2], [0, 1, 41]])
    names = ["angular_leaf_spot", "bean_rust", "healthy"]
    fig = plots.confusion_figure(cm, names, title="Confusion matrix (test split)")
    ax, bar = fig.axes
    counts = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in ax.texts}
    assert {k: int(t.get_text()) for k, t in counts.items()} == {(i, j): int(cm[i, j]) for i, j in zip(*np.nonzero(cm))}
    assert counts[(0, 0)].get_color() == "white" and counts[(1, 0)].get_color() != "white"  # ink readable on the shade
    assert [t.get_text() for t in ax.get_xticklabels()] == names == [t.get_text() for t in ax.get_yticklabels()]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("predicted class", "true class")
    assert bar.get_ylabel() == "fraction of the true class" and bar.get_ylim() == (0.0, 1.0)
    texts = [t.get_text() for t in fig.texts]
    assert "Confusion matrix (test split)" in texts and "125 images, 3 classes" in " ".join(texts)
    assert ax.get_xticklabels()[0].get_rotation() == 45  # "angular_leaf_spot" does not fit across a cell


def test_a_class_name_no_installed_font_can_draw_becomes_its_number_not_boxes(tmp_path: Path) -> None:
    undrawable = "rust \U0010fffd"  # a private-use character: no font draws it
    names = ["santé", undrawable, "healthy"]
    assert plots.drawable("santé") and not plots.drawable(undrawable)
    assert plots.class_labels(names) == ["santé", "class 1", "healthy"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "Glyph ... missing from font(s)" would fail here
        fig = plots.confusion_figure(np.eye(3, dtype=int) * 4, names)
        plots.plot_confusion(np.eye(3, dtype=int) * 4, names, tmp_path / "cm.png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["santé", "class 1", "healthy"]
    assert "DejaVu Sans" == plots._font_families()[0]  # the fallback fonts come after the default one


def test_confusion_with_40_long_class_names_stays_bounded(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    c = 40
    cm = np.diag(rng.integers(50, 400, c)) + rng.poisson(1.0, (c, c))
    names = [f"Tomato___Septoria_leaf_spot_with_a_very_long_name_variant_{i}" for i in range(c)]
    img = load(plots.plot_confusion(cm, names, tmp_path / "cm40.png"))
    assert img.shape[0] < 1400 and img.shape[1] < 1400  # scaled down to fit, names shortened
    fig = plots.confusion_figure(cm, names)
    ax = fig.axes[0]
    shades = cell_corner_colours(img, fig, c)
    frac = cm / cm.sum(axis=1, keepdims=True)
    for i in range(c):
        for j in range(c):
            assert near(shades[i, j][None], cmap_rgb(plots.CONFUSION_CMAP, frac[i, j]), tol=3) == 1, (i, j)
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert len(set(shown)) == c and all(len(s) <= 28 and s.endswith(f"_{i}") for i, s in enumerate(shown))
    assert ax.get_xticklabels()[0].get_rotation() == 90


def test_confusion_rejects_mismatched_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 class names for a 3x3 matrix"):
        plots.plot_confusion(np.eye(3, dtype=int), ["a", "b"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_non_ascii_class_names_have_every_glyph(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)"
        plots.plot_confusion(np.eye(2, dtype=int), ["Échaudure", "Blattflecken (Öl)"], tmp_path / "u.png")


def test_middle_ellipsis_keeps_distinguishing_ends() -> None:
    short = plots._ellipsize("Tomato___Septoria_leaf_spot_variant_12", 20)
    assert len(short) == 20 and short.startswith("Tomato") and short.endswith("_12") and "..." in short


# ---- contact sheet --------------------------------------------------------------------------------------
def test_contact_sheet_pastes_every_image_at_scale(tmp_path: Path) -> None:
    n, magenta = 11, (255, 0, 255)
    images = np.zeros((n, 32, 32, 3), np.uint8)
    images[:, 8:24, 8:24] = magenta  # a 16x16 magenta square in each image
    captions = [f"angular_leaf_spot -> bean_rust ({0.99 - i / 100:.2f})" for i in range(n)]
    img = load(plots.contact_sheet(images, captions, tmp_path / "hard.png", cols=4, scale=3))
    expected = n * (16 * 3) ** 2
    assert 0.9 * expected <= near(img, magenta, tol=8) <= expected + 50
    assert img.shape[1] >= 4 * 96  # four columns of 96-pixel tiles
    texts = " ".join(t.get_text() for t in plots.contact_sheet_figure(images, captions, cols=4, scale=3).texts)
    assert all(c in texts.replace("\n", " ") for c in captions)


def test_contact_sheet_empty_and_mismatched(tmp_path: Path) -> None:
    img = load(plots.contact_sheet(np.zeros((0, 32, 32, 3), np.uint8), [], tmp_path / "none.png"))
    assert img.std() > 5  # it says "no misclassified images"
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        plots.contact_sheet(np.zeros((2, 8, 8, 3), np.uint8), ["x"], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="uint8"):
        plots.contact_sheet(np.zeros((1, 8, 8, 3), np.float32), ["x"], tmp_path / "bad.png")


# ---- feature maps ---------------------------------------------------------------------------------------
def test_feature_map_grid_shows_colour_map_ends_and_source_images(tmp_path: Path) -> None:
    n, h, w, c = 3, 16, 16, 6
    maps = np.zeros((n, h, w, c))
    maps[..., 0] = np.linspace(-3, 5, w)[None, None, :]  # a ramp: both ends of the colour map
    maps[..., 1] = 7.0  # constant map: drawn flat, no NaN
    images = np.zeros((n, 24, 24, 3), np.uint8)
    images[:] = (0, 255, 255)
    img = load(plots.feature_map_grid(maps, tmp_path / "fm.png", images=images, labels=["a", "b", "c"],
                                      cell=48))
    lo, hi = (cmap_rgb(plots.FEATURE_CMAP, v) for v in (0.0, 1.0))
    assert near(img, hi, tol=4) > n * 48  # the bright end of each ramp
    assert near(img, lo, tol=4) > n * 5 * 48  # dark ends and the flat/zero maps
    assert near(img, (0, 255, 255), tol=4) >= 0.9 * n * 48 * 48  # the source images at the left


def test_feature_map_grid_keeps_the_most_varying_channels() -> None:
    maps = np.zeros((2, 4, 4, 10))
    rng = np.random.default_rng(0)
    for ch in (2, 5, 7):
        maps[..., ch] = rng.normal(size=(2, 4, 4))
    assert plots._select_channels(maps, 3).tolist() == [2, 5, 7]
    assert plots._select_channels(maps, 16).tolist() == list(range(10))
    texts = {t.get_text() for t in plots.feature_map_figure(maps, max_channels=3).texts}
    assert {"ch 2", "ch 5", "ch 7"} <= texts and "ch 0" not in texts


def test_feature_map_grid_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\(N, H, W, C\)"):
        plots.feature_map_grid(np.zeros((4, 4, 3)), tmp_path / "x.png")
    with pytest.raises(ValueError, match="NaN"):
        plots.feature_map_grid(np.full((1, 4, 4, 2), np.nan), tmp_path / "x.png")


# ---- atomic writes, the caller's matplotlib ------------------------------------------------------------
def test_writes_replace_atomically_and_leave_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "cm.png"
    plots.plot_confusion(np.eye(2, dtype=int), ["a", "b"], target)
    first = target.read_bytes()
    plots.plot_confusion(np.array([[1, 5], [0, 2]]), ["a", "b"], target)
    assert target.read_bytes() != first
    assert sorted(p.name for p in target.parent.iterdir()) == ["cm.png"]
    blocked = tmp_path / "blocked.png"
    blocked.mkdir()  # os.replace onto a directory fails: the temporary file must not stay behind
    with pytest.raises(OSError):
        plots.plot_confusion(np.eye(2, dtype=int), ["a", "b"], blocked)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked.png", "sub"]


def test_the_callers_matplotlib_settings_neither_change_the_figure_nor_are_changed(tmp_path: Path) -> None:
    reference = load(plots.plot_curves(history(12), tmp_path / "ref.png"))
    user_style = {"lines.linewidth": 7.0, "font.size": 30.0, "axes.facecolor": "black", "figure.dpi": 50.0}
    with matplotlib.rc_context(user_style):
        styled = load(plots.plot_curves(history(12), tmp_path / "styled.png"))
        assert all(matplotlib.rcParams[k] == v for k, v in user_style.items())  # restored for the caller
    assert np.array_equal(reference, styled)


def test_matplotlib_is_loaded_only_to_draw_and_never_through_pyplot(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from leaflens.pipeline.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "from leaflens.pipeline.report import plots\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported by --help or by importing plots'\n"
        f"plots.plot_confusion([[1, 0], [0, 1]], ['a', 'b'], {str(tmp_path / 'cm.png')!r})\n"
        "assert 'matplotlib' in sys.modules and 'matplotlib.pyplot' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
