"""pipeline.report.plots: each figure is a PNG Pillow re-opens, of the expected size, with the content it claims
(the curve colours, the pasted pixels, the colour-map ends), written atomically."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from leaflens.pipeline.report import plots


def load(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def near(img: np.ndarray, colour: tuple[int, int, int], tol: int = 24) -> int:
    """Pixels within ``tol`` (max channel difference) of ``colour``."""
    return int((np.abs(img.astype(int) - np.array(colour)).max(axis=-1) <= tol).sum())


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
    blue, orange = plots.PALETTE[0], plots.PALETTE[1]
    left, right = img[:, :600], img[:, 600:]
    for panel in (left, right):  # train (blue) and val (orange) curves drawn in both panels
        assert near(panel, blue) > 300 and near(panel, orange) > 300
    assert near(img, plots.PALETTE[2]) == 0  # no third series
    assert img.std() > 10


def test_curves_compare_runs_by_colour(tmp_path: Path) -> None:
    runs = {"distilled": history(30, 1.3), "scratch": history(30), "kd": history(30, 2)}
    img = load(plots.plot_curves(None, tmp_path / "c.png", series=runs))
    for colour in plots.PALETTE[:3]:
        assert near(img, colour) > 300
    with pytest.raises(ValueError, match="either history or series"):
        plots.plot_curves(history(3), tmp_path / "x.png", series={"a": history(3)})


def test_curves_skip_missing_values_and_draw_an_empty_panel(tmp_path: Path) -> None:
    rows = [{"epoch": 1, "train_loss": 1.0}, {"epoch": 2, "train_loss": None, "val_loss": float("nan")},
            {"epoch": 3, "train_loss": 0.5, "val_loss": 0.7}]
    img = load(plots.plot_curves(rows, tmp_path / "c.png"))  # no accuracies at all: right panel says so
    assert near(img[:, :600], plots.PALETTE[0]) > 50
    assert near(img[:, 600:], plots.PALETTE[0]) == 0 and near(img[:, 600:], plots.PALETTE[1]) == 0
    one = load(plots.plot_curves([{"train_loss": 0.4, "val_loss": 0.5}], tmp_path / "one.png",
                                 keys_right=()))  # a single epoch, a single panel
    assert near(one, plots.PALETTE[0]) > 20 and near(one, plots.PALETTE[1]) > 20


def test_losses_of_different_sizes_get_a_log_axis(tmp_path: Path) -> None:
    """A summed distillation loss (~20) beside a CE loss (~0.05..1): on a linear axis the CE curve is
    squashed into a few pixels; the automatic log axis spreads it out."""
    rows = [{"epoch": e + 1, "train_loss": 20 - e, "val_loss": 1.0 / (e + 1) ** 1.3} for e in range(10)]

    def orange_rows(img: np.ndarray) -> int:
        mask = np.abs(img.astype(int) - np.array(plots.PALETTE[1])).max(axis=-1) <= 24
        return int(mask[:450].any(axis=1).sum())  # rows of the plot area (above the legend) holding orange

    auto = load(plots.plot_curves(rows, tmp_path / "auto.png", keys_right=()))
    flat = load(plots.plot_curves(rows, tmp_path / "flat.png", keys_right=(), log_scale="off"))
    assert orange_rows(auto) > 150 > 60 > orange_rows(flat)
    with pytest.raises(ValueError, match="log_scale"):
        plots.plot_curves(rows, tmp_path / "x.png", log_scale="yes")


def test_log_ticks_bracket_the_data() -> None:
    lo, hi, ticks = plots.log_ticks(0.04, 19.5)
    assert (lo, hi) == (0.02, 20.0) and ticks == [0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
    assert plots.log_ticks(1e-4, 50.0)[2] == [1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0]  # decades only


def test_nice_ticks_cover_the_range_with_round_steps() -> None:
    lo, hi, ticks = plots.nice_ticks(0.137, 0.962)
    assert lo <= 0.137 and hi >= 0.962 and ticks[0] == lo and ticks[-1] == pytest.approx(hi)
    steps = np.diff(ticks)
    assert np.allclose(steps, steps[0]) and round(steps[0], 10) in (0.1, 0.2, 0.25, 0.5)
    assert plots.nice_ticks(1, 60, target=8, integer=True)[2][:3] == [0, 10, 20]
    assert plots.nice_ticks(3, 3)[0] < 3 < plots.nice_ticks(3, 3)[1]  # a flat series still gets a range


# ---- confusion matrix -----------------------------------------------------------------------------------
def test_confusion_heat_map_colours_and_size(tmp_path: Path) -> None:
    cm = np.array([[40, 0, 0], [3, 38, 2], [0, 1, 41]])
    img = load(plots.plot_confusion(cm, ["angular_leaf_spot", "bean_rust", "healthy"], tmp_path / "cm.png"))
    darkest = tuple(int(v) for v in plots.BLUES_LUT[255])  # row 0 is 100 % on the diagonal
    assert near(img, darkest, tol=6) > 1000
    assert 300 < img.shape[1] < 900 and 300 < img.shape[0] < 900
    assert img.std() > 20


def test_confusion_with_40_long_class_names_stays_bounded(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    c = 40
    cm = np.diag(rng.integers(50, 400, c)) + rng.poisson(1.0, (c, c))
    names = [f"Tomato___Septoria_leaf_spot_with_a_very_long_name_variant_{i}" for i in range(c)]
    img = load(plots.plot_confusion(cm, names, tmp_path / "cm40.png"))
    assert img.shape[0] < 1400 and img.shape[1] < 1400  # scaled down to fit, names shortened
    assert near(img, tuple(int(v) for v in plots.BLUES_LUT[255]), tol=40) > 40 * 100  # 40 dark diagonal cells


def test_confusion_rejects_mismatched_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 class names for a 3x3 matrix"):
        plots.plot_confusion(np.eye(3, dtype=int), ["a", "b"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


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
    lo, hi = (tuple(int(v) for v in plots.VIRIDIS_LUT[i]) for i in (0, 255))
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


def test_feature_map_grid_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\(N, H, W, C\)"):
        plots.feature_map_grid(np.zeros((4, 4, 3)), tmp_path / "x.png")
    with pytest.raises(ValueError, match="NaN"):
        plots.feature_map_grid(np.full((1, 4, 4, 2), np.nan), tmp_path / "x.png")


# ---- atomic writes --------------------------------------------------------------------------------------
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


def test_bitmap_font_fallback_still_draws_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Pillow builds without FreeType the old bitmap font is scaled instead."""
    monkeypatch.setattr(plots, "_font", lambda px, unicode=False: None)
    mask = plots._text_mask("healthy", 24)
    assert mask.size[1] >= 20 and np.asarray(mask).max() > 0
