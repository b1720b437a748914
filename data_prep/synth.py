"""The built-in synthetic leaf dataset: photo-like leaves drawn procedurally, no downloads needed.

Every image shows one leaf of random shape (ellipse to egg-shaped, smooth or serrated), size,
colour, rotation and venation on a random background (soil, hand, sky, bench, grass), under random
lighting (gain, white balance, a directional gradient, a cast shadow) with optional blur and
sensor noise. The class is carried only by local signs drawn on the leaf:

- healthy: nothing (veins, natural colour variation, occasional specular glints)
- rust: clusters of small raised orange-brown pustules with a faint yellow halo
- early_blight: a few brown lesions with concentric rings and a yellow halo
- powdery_mildew: diffuse white powdery patches
- bacterial_spot: many small dark water-soaked spots with thin yellow margins
- mosaic_virus: mottled light/dark green patches over the whole blade
- aphids: clusters of small dark or pale insects along the veins
- leaf_miner: winding pale trails that widen along their length, with a dark frass line

With ``unlabeled_fraction`` F, a seeded share F of each class's photos is written to ``unlabeled/``
instead of the class folder, under names that do not tell the class (``unlabeled/unlabeled_NNNNN.jpg``,
numbered in a shuffled order): the pipeline uses them as photos without labels (teacher features and
distillation targets, never cross-entropy), which is where learning from a teacher pays. Their classes
are kept in synth.json (``unlabeled``) for checks only; preprocessing and training never read them.
The photos themselves do not depend on F: each is drawn from its class and index alone.

Nuisance factors (leaf colour, background, light) dominate the image mean, so the classes are not
separable by mean colour alone (tests/data_prep/test_synth.py checks a nearest-class-mean
classifier on mean RGB). Rendering is vectorised NumPy plus Pillow drawing; files are written by a
process pool. Everything is seeded per image, so the output does not depend on the worker count.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from leaflens.cpus import usable_cpus, worker_pool
from leaflens.files import check_replaceable, new_temp_dir, swap_into_place
from leaflens.records import Record

CLASS_INFO: dict[str, dict[str, str]] = {
    "healthy": {
        "name": "Healthy", "name_zh": "健康",
        "description": "No visible disease or pest damage; even green colour and intact veins.",
        "description_zh": "未见病害或虫害；叶色均匀，叶脉完整。",
        "advice": "No action needed. Keep regular watering and scouting.",
        "advice_zh": "无需处理。保持正常浇水并定期巡查。",
    },
    "rust": {
        "name": "Rust", "name_zh": "锈病",
        "description": "Fungal disease: small raised orange to reddish-brown pustules that release "
                       "powdery spores.",
        "description_zh": "真菌病害：叶面出现橙色至红褐色的小隆起孢子堆，可散出粉状孢子。",
        "advice": "Remove badly infected leaves, avoid wetting foliage, improve air flow; use a registered "
                  "fungicide if it spreads.",
        "advice_zh": "摘除重病叶，避免叶面淋水，改善通风；病情扩展时使用登记的杀菌剂。",
    },
    "early_blight": {
        "name": "Early blight", "name_zh": "早疫病",
        "description": "Fungal disease (Alternaria): brown lesions with concentric 'target' rings and a "
                       "yellow halo.",
        "description_zh": "真菌病害（链格孢）：褐色病斑带同心轮纹，周围有黄色晕圈。",
        "advice": "Remove lower infected leaves, mulch to stop soil splash, rotate crops; apply a protectant "
                  "fungicide when lesions appear.",
        "advice_zh": "摘除下部病叶，覆盖地面防止泥水飞溅，实行轮作；出现病斑时喷施保护性杀菌剂。",
    },
    "powdery_mildew": {
        "name": "Powdery mildew", "name_zh": "白粉病",
        "description": "Fungal disease: white to grey powdery patches on the leaf surface.",
        "description_zh": "真菌病害：叶面出现白色至灰白色粉状霉斑。",
        "advice": "Improve air circulation and light, avoid excess nitrogen; sulfur or potassium bicarbonate "
                  "sprays help early.",
        "advice_zh": "改善通风透光，避免偏施氮肥；初期可喷硫磺或碳酸氢钾制剂。",
    },
    "bacterial_spot": {
        "name": "Bacterial spot", "name_zh": "细菌性斑点病",
        "description": "Bacterial disease: many small dark, water-soaked spots, often with a yellow margin.",
        "description_zh": "细菌病害：叶面出现许多暗色水渍状小斑点，常带黄色边缘。",
        "advice": "Use clean seed and transplants, avoid overhead watering and working wet plants; copper "
                  "sprays can slow spread.",
        "advice_zh": "使用无病种子和种苗，避免喷灌及在植株潮湿时操作；铜制剂可减缓扩散。",
    },
    "mosaic_virus": {
        "name": "Mosaic virus", "name_zh": "花叶病毒病",
        "description": "Viral disease: mottled light and dark green patches, sometimes with distorted "
                       "leaves.",
        "description_zh": "病毒病害：叶片呈浓淡相间的绿色斑驳，有时叶片畸形。",
        "advice": "No cure: remove infected plants, control aphids and other vectors, disinfect tools, use "
                  "resistant varieties.",
        "advice_zh": "无法治愈：拔除病株，防治蚜虫等传毒媒介，消毒工具，选用抗病品种。",
    },
    "aphids": {
        "name": "Aphids", "name_zh": "蚜虫",
        "description": "Pest: clusters of small soft-bodied insects, usually along veins and on the "
                       "underside.",
        "description_zh": "虫害：成群的小型软体昆虫，常聚集在叶脉旁和叶背。",
        "advice": "Wash off with water, encourage ladybirds and lacewings, use insecticidal soap if numbers "
                  "keep rising.",
        "advice_zh": "用清水冲洗，保护瓢虫、草蛉等天敌；数量持续增加时使用杀虫皂。",
    },
    "leaf_miner": {
        "name": "Leaf miner", "name_zh": "潜叶蝇",
        "description": "Pest: larvae tunnel inside the leaf, leaving winding pale trails.",
        "description_zh": "虫害：幼虫在叶肉内取食，留下弯曲的白色虫道。",
        "advice": "Remove and destroy mined leaves, use yellow sticky traps for adults, protect parasitic "
                  "wasps.",
        "advice_zh": "摘除并销毁受害叶片，用黄色粘虫板诱杀成虫，保护寄生蜂。",
    },
}
CLASSES = tuple(CLASS_INFO)
BACKGROUNDS = ("soil", "hand", "sky", "bench", "grass")
SYNTH_META = "synth.json"
UNLABELED_DIR = "unlabeled"  # the folder name scan.py reads as photos without labels
CLASSES_TOML = "classes.toml"
RENDER_SIZE = 256
_ELLIPSE_ANGLES = np.linspace(0, 2 * math.pi, 10)
BrokenKind = Literal["truncated", "empty", "not_an_image"]
_BROKEN_KINDS: tuple[BrokenKind, ...] = ("truncated", "empty", "not_an_image")
# EXIF orientation -> transpose that stores the upright picture so a viewer shows it upright again.
_STORE_FOR_ORIENTATION = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90,
                          8: Image.Transpose.ROTATE_270}


@dataclass(frozen=True)
class SynthOptions(Record):
    per_class: int = 300
    size: int = 256
    seed: int = 0
    broken: int = 6  # deliberately broken files, spread over the classes
    exif_fraction: float = 0.03  # images stored rotated with an EXIF orientation tag
    unlabeled_fraction: float = 0.0  # share of each class's photos written to unlabeled/ (labels withheld)


@dataclass(frozen=True)
class RotatedFile(Record):
    """A photo stored turned, with the EXIF orientation tag that turns it upright again."""

    path: str  # relative to the synthetic folder
    orientation: int


@dataclass(frozen=True)
class BrokenFile(Record):
    """A deliberately broken file and how it is broken (what ingest must reject it as)."""

    path: str
    kind: BrokenKind


@dataclass(frozen=True)
class UnlabeledFile(Record):
    """A photo written to unlabeled/ and the class it was drawn from (withheld from the pipeline)."""

    path: str  # relative to the synthetic folder
    withheld_class: str


@dataclass(frozen=True)
class SynthInfo(Record):
    """synth.json: how the synthetic photos were made and which files are odd on purpose."""

    generator: str
    options: SynthOptions
    classes: tuple[str, ...]
    images_per_class: int  # drawn per class, the ones written to unlabeled/ included
    backgrounds: tuple[str, ...]
    exif_rotated: tuple[RotatedFile, ...]
    broken: tuple[BrokenFile, ...]
    unlabeled: tuple[UnlabeledFile, ...] = ()


# ---------------------------------------------------------------------------- drawing helpers
_GRIDS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _grid(s: int) -> tuple[np.ndarray, np.ndarray]:
    if s not in _GRIDS:
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float32)
        _GRIDS[s] = (yy, xx)
    return _GRIDS[s]


def _noise(rng: np.random.Generator, s: int, cells: int) -> np.ndarray:
    """Smooth value noise in about [0, 1]: a random cells x cells grid upsampled bicubically."""
    g = rng.random((cells + 1, cells + 1), dtype=np.float32)
    return np.asarray(Image.fromarray(g, mode="F").resize((s, s), Image.Resampling.BICUBIC))


def _mix(img: np.ndarray, colour, alpha: np.ndarray) -> np.ndarray:
    """img * (1 - alpha) + colour * alpha, in place and only over the rows/columns alpha touches."""
    rows = np.flatnonzero(alpha.any(axis=1))
    if rows.size == 0:
        return img
    cols = np.flatnonzero(alpha.any(axis=0))
    y0, y1, x0, x1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    win = img[y0:y1, x0:x1]
    colour = np.asarray(colour, np.float32)
    delta = colour - win if colour.ndim < 3 else colour[y0:y1, x0:x1] - win
    delta *= alpha[y0:y1, x0:x1, None]
    win += delta
    return img


def _mask_from_draw(s: int, draw_fn, blur: float) -> np.ndarray:
    """Draw with PIL on an 'L' canvas, soften (only around what was drawn), return alpha in [0, 1]."""
    canvas = Image.new("L", (s, s), 0)
    draw_fn(ImageDraw.Draw(canvas))
    out = np.zeros((s, s), np.float32)
    box = canvas.getbbox()
    if box is None:
        return out
    if blur > 0:
        m = int(math.ceil(3 * blur)) + 1
        box = (max(0, box[0] - m), max(0, box[1] - m), min(s, box[2] + m), min(s, box[3] + m))
        part = canvas.crop(box).filter(ImageFilter.GaussianBlur(blur))
    else:
        part = canvas.crop(box)
    out[box[1]:box[3], box[0]:box[2]] = np.asarray(part, np.float32) * (1.0 / 255.0)
    return out


def _sample_in(rng: np.random.Generator, mask: np.ndarray, n: int) -> np.ndarray:
    """n (y, x) pixel positions where ``mask`` is set."""
    idx = np.flatnonzero(mask.ravel())
    pick = rng.choice(idx, size=n, replace=len(idx) < n)
    return np.stack(np.divmod(pick, mask.shape[1]), axis=1).astype(np.float32)


# ---------------------------------------------------------------------------- backgrounds
def _background(rng: np.random.Generator, s: int, kind: str) -> np.ndarray:
    """Background drawn at half resolution and upsampled: cheaper, and a slightly soft background
    is what a close-up phone photo shows anyway (shallow depth of field)."""
    half = _background_at(rng, s // 2, kind)
    up = Image.fromarray(np.clip(half * 255 + 0.5, 0, 255).astype(np.uint8))
    up = up.resize((s, s), Image.Resampling.BILINEAR)
    return np.asarray(up, np.float32) * (1.0 / 255.0)


def _background_at(rng: np.random.Generator, s: int, kind: str) -> np.ndarray:
    yy, xx = _grid(s)
    if kind == "soil":
        base = rng.uniform((0.25, 0.17, 0.08), (0.55, 0.38, 0.22)).astype(np.float32)
        tex = 0.6 * _noise(rng, s, 24) + 0.4 * _noise(rng, s, 56) - 0.5
        img = base * (1 + 0.45 * tex[..., None])
        pebbles = _mask_from_draw(s, lambda d: [d.ellipse((x, y, x + r, y + r * 0.8), fill=255) for x, y, r in
                                                zip(rng.uniform(0, s, 25), rng.uniform(0, s, 25),
                                                    rng.uniform(1, 3.5, 25))], 0.4)
        img = _mix(img, base * 1.7, pebbles * 0.7)
    elif kind == "hand":
        tones = np.array([[0.93, 0.76, 0.65], [0.80, 0.60, 0.47], [0.62, 0.43, 0.31], [0.40, 0.27, 0.19]],
                         np.float32)
        t = rng.uniform(0, len(tones) - 1)
        base = tones[int(t)] + (tones[min(int(t) + 1, 3)] - tones[int(t)]) * (t - int(t))
        shade = 0.85 + 0.3 * _noise(rng, s, 3)
        img = base * shade[..., None]
        ang = rng.uniform(0, math.pi)
        lines = np.sin(((xx * math.cos(ang) + yy * math.sin(ang)) / s * rng.uniform(4, 9)) * math.pi)
        img = img * (1 - 0.08 * (lines[..., None] > 0.97))
    elif kind == "sky":
        top = np.array([rng.uniform(0.15, 0.45), rng.uniform(0.35, 0.6), rng.uniform(0.7, 0.95)], np.float32)
        bottom = np.array([0.75, 0.85, 0.95], np.float32)
        height = (yy / s)[..., None]  # 0 at the top row, 1 at the bottom
        img = top * (1 - height) + bottom * height
        cloud = np.clip((_noise(rng, s, 6) - rng.uniform(0.45, 0.7)) * 3.5, 0, 1)
        img = _mix(img, (0.96, 0.96, 0.97), cloud)
    elif kind == "bench":
        if rng.random() < 0.6:  # wood planks
            base = rng.uniform((0.45, 0.3, 0.15), (0.75, 0.5, 0.3)).astype(np.float32)
            warp = _noise(rng, s, 5) * rng.uniform(5, 15)
            across = yy if rng.random() < 0.5 else xx
            along = xx if across is yy else yy
            grain = np.sin((across + warp) * rng.uniform(0.5, 1.2)) * 0.08
            plank = (np.floor((across + 0.02 * along) / rng.uniform(20, 45)) % 2) * 0.08
            img = base * (1 + grain - plank)[..., None]
        else:  # grey or white plastic / metal bench
            g = rng.uniform(0.35, 0.9)
            img = np.full((s, s, 3), g, np.float32) * (0.95 + 0.1 * _noise(rng, s, 4))[..., None]
    else:  # grass / foliage: the hardest case for colour-based shortcuts
        base = np.array([rng.uniform(0.1, 0.35), rng.uniform(0.25, 0.5), rng.uniform(0.05, 0.2)], np.float32)
        tex = 0.5 * _noise(rng, s, 16) + 0.5 * _noise(rng, s, 48) - 0.5
        img = base * (1 + 0.8 * tex[..., None])
    return img.astype(np.float32)


# ---------------------------------------------------------------------------- the leaf
@dataclass
class _Leaf:
    mask: np.ndarray  # soft alpha in [0, 1]
    inner: np.ndarray  # bool, safely inside the blade
    u: np.ndarray  # along the midrib, -1 (base) .. 1 (tip)
    v: np.ndarray  # across, in units of the half length
    vein: np.ndarray  # vein strength in [0, 1]
    half_len: float
    cx: float
    cy: float
    theta: float


def _leaf(rng: np.random.Generator, s: int) -> _Leaf:
    yy, xx = _grid(s)
    cx, cy = s / 2 + rng.uniform(-0.08, 0.08) * s, s / 2 + rng.uniform(-0.08, 0.08) * s
    theta = rng.uniform(0, 2 * math.pi)
    a = s * rng.uniform(0.30, 0.47)
    ct, st = math.cos(theta), math.sin(theta)
    dx, dy = xx - cx, yy - cy
    u = (dx * ct + dy * st) / a
    v = (-dx * st + dy * ct) / a
    wr = rng.uniform(0.28, 0.6)
    p = rng.uniform(0.5, 1.0)
    k = rng.uniform(-0.35, 0.35)
    uc = np.clip(u, -1, 1)
    w = wr * np.power(np.clip(1 - uc * uc, 0, 1), p) * (1 + k * uc)
    if rng.random() < 0.5:  # serrated margin
        teeth = rng.uniform(12, 30)
        w = w * (1 - rng.uniform(0.02, 0.07) * (0.5 + 0.5 * np.sin(teeth * math.pi * uc)))
    dist_px = (w - np.abs(v)) * a
    mask = np.clip(dist_px + 0.5, 0, 1) * (np.abs(u) < 1)
    # Petiole (stalk) at the base.
    stalk = (u < -0.95) & (u > -1.0 - rng.uniform(0.1, 0.3)) & (np.abs(v) * a < 1.6)
    mask = np.maximum(mask, stalk.astype(np.float32))
    inner = dist_px > 3
    # Veins: midrib plus paired laterals slanting towards the tip.
    mid = np.clip(1 - np.abs(v) * a / (1.2 + 1.5 * (1 - uc) / 2), 0, 1)
    slope = rng.uniform(0.6, 1.6)
    spacing = rng.uniform(0.12, 0.25)
    phase = (uc - np.abs(v) * slope) / spacing
    lat = np.clip(1 - np.abs(phase - np.round(phase)) * spacing * a / 0.9, 0, 1)
    lat = lat * (np.abs(v) < 0.9 * w)
    vein = np.maximum(mid, 0.7 * lat) * (mask > 0.5)
    return _Leaf(mask.astype(np.float32), inner, u, v, vein.astype(np.float32), a, cx, cy, theta)


def _leaf_colour(rng: np.random.Generator, s: int, leaf: _Leaf) -> np.ndarray:
    palette = np.array([[0.55, 0.68, 0.20], [0.30, 0.55, 0.18], [0.14, 0.38, 0.12], [0.20, 0.45, 0.30],
                        [0.45, 0.55, 0.15], [0.35, 0.48, 0.12]], np.float32)
    w = rng.dirichlet(np.full(len(palette), 0.5)).astype(np.float32)
    base = w @ palette
    var = 0.85 + 0.3 * _noise(rng, s, 5)
    shade = 1 + rng.uniform(0.05, 0.2) * np.clip(leaf.v * 3, -1, 1)  # curvature: one side lighter
    img = base * (var * shade)[..., None]
    vein_col = np.clip(base * rng.uniform(1.15, 1.5) + 0.05, 0, 1)
    if rng.random() < 0.25:
        vein_col = base * 0.7  # dark-veined leaves exist too
    return _mix(img, vein_col, leaf.vein * rng.uniform(0.35, 0.8)).astype(np.float32)


# ---------------------------------------------------------------------------- disease signs
def _spots(rng, s, leaf, n, r_range, blur):
    pts = _sample_in(rng, leaf.inner, n)
    radii = rng.uniform(*r_range, size=n)
    aspect = rng.uniform(0.7, 1.3, size=n)

    def draw(scale):
        def fn(d):
            for (y, x), r, q in zip(pts, radii, aspect):
                rr = r * scale
                d.ellipse((x - rr * q, y - rr / q, x + rr * q, y + rr / q), fill=255)
        return fn
    return pts, radii, draw


def _rust(rng, img, s, leaf):
    n_clusters = rng.integers(2, 7)
    centres = _sample_in(rng, leaf.inner, n_clusters)
    pts = np.concatenate([c + rng.normal(0, rng.uniform(6, 20), (rng.integers(8, 30), 2)) for c in centres])
    inside = leaf.inner[np.clip(pts[:, 0].astype(int), 0, s - 1), np.clip(pts[:, 1].astype(int), 0, s - 1)]
    pts = pts[inside]
    radii = rng.uniform(1.6, 3.4, len(pts))

    def pust(scale):
        return lambda d: [d.ellipse((x - r * scale, y - r * scale, x + r * scale, y + r * scale), fill=255)
                          for (y, x), r in zip(pts, radii)]
    halo = _mask_from_draw(s, pust(2.2), 1.5)
    core = _mask_from_draw(s, pust(1.0), 0.6)
    img = _mix(img, (0.75, 0.7, 0.2), halo * 0.35 * leaf.mask)
    col = np.array([rng.uniform(0.7, 0.9), rng.uniform(0.35, 0.5), rng.uniform(0.05, 0.15)], np.float32)
    img = _mix(img, col, core * 0.95 * leaf.mask)
    # raised pustules: a lighter centre
    centre = _mask_from_draw(s, pust(0.45), 0.4)
    return _mix(img, np.clip(col * 1.25, 0, 1), centre * 0.6 * leaf.mask)


def _early_blight(rng, img, s, leaf):
    yy, xx = _grid(s)
    for (y, x) in _sample_in(rng, leaf.inner, rng.integers(1, 5)):
        r = rng.uniform(7, 20)
        period = rng.uniform(2.5, 4.5)
        y0, y1 = int(max(0, y - 2 * r)), int(min(s, y + 2 * r + 1))
        x0, x1 = int(max(0, x - 2 * r)), int(min(s, x + 2 * r + 1))
        wy, wx = yy[y0:y1, x0:x1], xx[y0:y1, x0:x1]
        ang = np.arctan2(wy - y, wx - x)
        wobble = 1 + 0.15 * np.sin(3 * ang + rng.uniform(0, 6)) + 0.08 * np.sin(5 * ang + rng.uniform(0, 6))
        d = np.hypot(wy - y, wx - x) / wobble
        m = leaf.mask[y0:y1, x0:x1]
        halo = np.clip((1.6 * r - d) / (0.6 * r), 0, 1) * np.clip((d - 0.8 * r) / (0.2 * r), 0, 1) * m
        body = np.clip(r - d + 0.5, 0, 1) * m
        rings = 0.5 + 0.5 * np.cos(2 * math.pi * d / period)
        dark = np.array([0.25, 0.16, 0.08], np.float32)
        light = np.array([0.5, 0.36, 0.18], np.float32)
        lesion = dark + (light - dark) * rings[..., None]
        win = img[y0:y1, x0:x1]
        win = _mix(win, (0.85, 0.78, 0.2), halo * 0.6)
        win = win * (1 - body[..., None]) + lesion * body[..., None]
        img[y0:y1, x0:x1] = win
    return img


def _powdery_mildew(rng, img, s, leaf):
    blobs = np.clip((_noise(rng, s, int(rng.integers(5, 10))) - rng.uniform(0.5, 0.65)) * 4, 0, 1)
    grain = 0.6 + 0.4 * _noise(rng, s, 90)
    alpha = blobs * grain * rng.uniform(0.55, 0.85) * leaf.mask
    # small colonies scattered too
    spots = _mask_from_draw(s, lambda d: [d.ellipse((x - r, y - r, x + r, y + r), fill=255) for (y, x), r in
                                          zip(_sample_in(rng, leaf.inner, 12), rng.uniform(3, 8, 12))], 2.5)
    alpha = np.maximum(alpha, spots * 0.6 * grain * leaf.mask)
    return _mix(img, (0.92, 0.93, 0.9), alpha)


def _bacterial_spot(rng, img, s, leaf):
    n = int(rng.integers(25, 80))
    _, _, draw = _spots(rng, s, leaf, n, (1.5, 3.8), 0)
    halo = _mask_from_draw(s, draw(1.7), 1.0)
    core = _mask_from_draw(s, draw(1.0), 0.5)
    img = _mix(img, (0.7, 0.68, 0.2), halo * 0.45 * leaf.mask)
    col = np.array([rng.uniform(0.08, 0.18), rng.uniform(0.08, 0.15), rng.uniform(0.03, 0.08)], np.float32)
    return _mix(img, col, core * 0.92 * leaf.mask)


def _mosaic_virus(rng, img, s, leaf):
    n = _noise(rng, s, int(rng.integers(7, 14)))
    patches = np.clip((n - 0.5) * rng.uniform(5, 9) + 0.5, 0, 1)
    light = np.clip(img * np.array([1.45, 1.3, 0.9], np.float32) + np.array([0.08, 0.06, 0], np.float32),
                    0, 1)
    dark = img * 0.72
    strength = rng.uniform(0.6, 0.9) * leaf.mask
    mottled = dark + (light - dark) * patches[..., None]
    return img + (mottled - img) * strength[..., None]


def _aphids(rng, img, s, leaf):
    pil = Image.fromarray(np.clip(img * 255, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(pil)
    vein_pts = _sample_in(rng, (leaf.vein > 0.6) & leaf.inner, int(rng.integers(2, 5)))
    dark = rng.random() < 0.6
    for (y, x) in vein_pts:
        m = int(rng.integers(6, 22))
        along = leaf.theta + (0 if rng.random() < 0.5 else rng.uniform(-1.2, 1.2))
        t = rng.normal(0, rng.uniform(8, 18), m)
        off = rng.normal(0, 3, m)
        for ti, oi in zip(t, off):
            px = x + ti * math.cos(along) - oi * math.sin(along)
            py = y + ti * math.sin(along) + oi * math.cos(along)
            if not (0 <= px < s and 0 <= py < s) or leaf.mask[int(py), int(px)] < 0.5:
                continue
            ln, wd = rng.uniform(2.5, 4.5), rng.uniform(1.6, 2.6)
            ang = along + rng.normal(0, 0.6)
            ca, sa = math.cos(ang), math.sin(ang)
            poly = [(px + ln * math.cos(q) * ca - wd * math.sin(q) * sa,
                     py + ln * math.cos(q) * sa + wd * math.sin(q) * ca) for q in _ELLIPSE_ANGLES]
            if dark:
                col = tuple(int(c) for c in rng.uniform([15, 15, 10], [60, 50, 35]))
            else:
                col = tuple(int(c) for c in rng.uniform([150, 170, 60], [200, 215, 110]))
            d.polygon(poly, fill=col, outline=(30, 35, 20))
    return np.asarray(pil, np.float32) / 255.0


def _leaf_miner(rng, img, s, leaf):
    trails = []
    for _ in range(int(rng.integers(1, 4))):
        (y, x), = _sample_in(rng, leaf.inner, 1)
        ang = rng.uniform(0, 2 * math.pi)
        pts = [(x, y)]
        for _ in range(int(rng.integers(80, 220))):
            ang += rng.normal(0, 0.35)
            nx, ny = x + 2.0 * math.cos(ang), y + 2.0 * math.sin(ang)
            if not (0 <= nx < s and 0 <= ny < s) or not leaf.inner[int(ny), int(nx)]:
                ang += math.pi * rng.uniform(0.5, 1.0)
                continue
            x, y = nx, ny
            pts.append((x, y))
        trails.append(pts)

    def draw(width_scale):
        def fn(d):
            for pts in trails:
                n = len(pts)
                for j in range(0, n - 1, 4):  # widening trail, drawn in short segments
                    wdt = max(1, int(round((1.5 + 3.0 * j / n) * width_scale)))
                    d.line(pts[j:j + 5], fill=255, width=wdt, joint="curve")
        return fn
    trail = _mask_from_draw(s, draw(1.0), 0.7)
    frass = _mask_from_draw(s, draw(0.3), 0.3)
    img = _mix(img, (0.86, 0.88, 0.72), trail * 0.85 * leaf.mask)
    return _mix(img, (0.25, 0.22, 0.12), frass * 0.5 * leaf.mask)


def _healthy(rng, img, s, leaf):
    if rng.random() < 0.4:  # specular glints / dew: bright spots that are not disease
        pts, radii = _sample_in(rng, leaf.inner, 6), rng.uniform(2, 5, 6)
        glints = _mask_from_draw(s, lambda d: [d.ellipse((x - r, y - r, x + r, y + r), fill=255)
                                               for (y, x), r in zip(pts, radii)], 2.0)
        img = _mix(img, (0.95, 0.97, 0.95), glints * 0.5 * leaf.mask)
    return img


_SIGNS = {"healthy": _healthy, "rust": _rust, "early_blight": _early_blight,
          "powdery_mildew": _powdery_mildew, "bacterial_spot": _bacterial_spot,
          "mosaic_virus": _mosaic_virus, "aphids": _aphids, "leaf_miner": _leaf_miner}


# ---------------------------------------------------------------------------- one image
def render(cls: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw one upright (size, size, 3) uint8 image of class ``cls``.

    Drawing happens at 256 x 256 (all sizes of leaves, spots and insects are tuned for it) and is
    resized with antialiasing when another ``size`` is asked for.
    """
    if cls not in _SIGNS:
        raise ValueError(f"unknown synthetic class {cls!r}; known: {', '.join(CLASSES)}")
    arr = _render_base(cls, rng)
    if size != RENDER_SIZE:
        arr = np.asarray(Image.fromarray(arr).resize((size, size), Image.Resampling.LANCZOS))
    return arr


def _render_base(cls: str, rng: np.random.Generator) -> np.ndarray:
    s = RENDER_SIZE
    bg = _background(rng, s, BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))])
    leaf = _leaf(rng, s)
    img = _leaf_colour(rng, s, leaf)
    img = _SIGNS[cls](rng, img, s, leaf)
    # Cast shadow of the leaf on the background (blurred at quarter resolution), then composite.
    sx, sy = rng.integers(-8, 9, 2)
    small = Image.fromarray((leaf.mask * 255).astype(np.uint8)).resize((s // 4, s // 4), Image.Resampling.BOX)
    small = small.filter(ImageFilter.GaussianBlur(1)).resize((s, s), Image.Resampling.BILINEAR)
    shadow = np.roll(np.asarray(small, np.float32), (int(sy), int(sx)), axis=(0, 1))
    bg *= (1 - rng.uniform(0.2, 0.5) / 255.0 * shadow)[..., None]
    out = _mix(bg, img, leaf.mask)
    # Lighting: gain, white balance, directional gradient.
    yy, xx = _grid(s)
    ang = rng.uniform(0, 2 * math.pi)
    grad = (rng.uniform(0, 0.35) / s * math.cos(ang)) * (xx - s / 2)
    grad += (rng.uniform(0, 0.35) / s * math.sin(ang)) * (yy - s / 2)
    grad += 1.0
    grad *= rng.uniform(0.55, 1.35) * 255.0
    out *= grad[..., None]
    out *= rng.uniform(0.85, 1.15, 3).astype(np.float32)
    out += 0.5
    np.clip(out, 0, 255, out=out)
    arr = out.astype(np.uint8)
    if rng.random() < 0.7:  # sensor noise (triangular, integer: cheap)
        k = int(rng.integers(1, 6))
        noise = rng.integers(-k, k + 1, arr.shape, dtype=np.int16) + rng.integers(-k, k + 1, arr.shape,
                                                                                   dtype=np.int16)
        arr = np.clip(arr + noise, 0, 255).astype(np.uint8)
    pil = Image.fromarray(arr)
    if rng.random() < 0.3:
        pil = pil.filter(ImageFilter.GaussianBlur(rng.uniform(0.4, 1.6)))
    return np.asarray(pil)


def image_seed(seed: int, class_index: int, i: int) -> list[int]:
    """The per-image seed sequence (independent of the worker that renders it)."""
    return [seed, class_index, i]


def _worker_init() -> None:
    """Pool-worker setup: keep freed image-sized buffers in the heap instead of returning them.

    glibc serves allocations above 128 KiB with fresh mmap()s that must be page-faulted and zeroed
    every time; rendering allocates dozens of 256x256 float arrays per image, and raising the mmap
    and trim thresholds in the worker processes cuts their CPU time by about a fifth. No effect
    (and no error) where glibc's mallopt is not available.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _render_task(task: tuple[str, int, int, int, int, str, float]) -> tuple[str, int]:
    """Worker: render one image and write it as JPEG (maybe stored rotated with an EXIF tag)."""
    cls, ci, i, size, seed, path, exif_fraction = task
    rng = np.random.default_rng(image_seed(seed, ci, i))
    arr = render(cls, size, rng)
    quality = int(rng.integers(72, 96))
    orientation = 1
    im = Image.fromarray(arr)
    if rng.random() < exif_fraction:
        orientation = int(rng.choice([3, 6, 8]))
        im = im.transpose(_STORE_FOR_ORIENTATION[orientation])
        exif = Image.Exif()
        exif[0x0112] = orientation
        im.save(path, "JPEG", quality=quality, exif=exif.tobytes())
    else:
        im.save(path, "JPEG", quality=quality)
    return path, orientation


# ---------------------------------------------------------------------------- the dataset
def _toml_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON strings are valid TOML basic strings


def classes_toml(classes: tuple[str, ...] = CLASSES) -> str:
    """``classes.toml`` text: display name, description and advice per class, English + Chinese."""
    lines = ["# Class display names, descriptions and advice (English / Simplified Chinese).",
             "# Written by `leaflens data synth`; the app shows these next to predictions.", ""]
    for c in classes:
        lines.append(f"[classes.{c}]")
        for key in ("name", "name_zh", "description", "description_zh", "advice", "advice_zh"):
            lines.append(f"{key} = {_toml_str(CLASS_INFO[c][key])}")
        lines.append("")
    return "\n".join(lines)


def _up_to_date(out: Path, opts: SynthOptions) -> SynthInfo | None:
    """The folder's synth.json when it was made with ``opts`` and is complete (else None: make it again;
    a synth.json this version cannot read, an unknown key included, counts as out of date)."""
    try:
        meta = SynthInfo.from_dict(json.loads((out / SYNTH_META).read_text(encoding="utf-8")), str(out / SYNTH_META))
    except (OSError, ValueError):
        return None
    folders = list(CLASSES) + ([UNLABELED_DIR] if meta.unlabeled else [])
    return meta if meta.options == opts and all((out / c).is_dir() for c in folders) else None


def unlabeled_counts(opts: SynthOptions) -> int:
    """How many of each class's photos go to unlabeled/: ``unlabeled_fraction`` of ``per_class``, rounded."""
    return int(round(opts.unlabeled_fraction * opts.per_class))


def _unlabeled_names(opts: SynthOptions) -> dict[tuple[int, int], str]:
    """(class index, image index) -> file name in unlabeled/ for the photos whose labels are withheld.

    Each class's share is drawn by its own seeded generator; the names are numbered in a shuffled order
    over all classes, so neither a name nor its place in a listing tells the class.
    """
    n = unlabeled_counts(opts)
    picked = [(ci, int(i)) for ci in range(len(CLASSES))
              for i in np.sort(np.random.default_rng([opts.seed, 77711, ci]).choice(opts.per_class, n,
                                                                                    replace=False))]
    order = np.random.default_rng([opts.seed, 77712]).permutation(len(picked))
    return {picked[k]: f"{UNLABELED_DIR}_{j:05d}.jpg" for j, k in enumerate(order)}


def generate(out: str | os.PathLike, options: SynthOptions | None = None, *, workers: int | None = None,
             force: bool = False, progress: bool = False, log=print) -> SynthInfo:
    """Write the synthetic dataset to ``out`` (atomically); returns the metadata written to synth.json.

    Layout: ``out/<class>/<class>_NNNN.jpg``, ``out/unlabeled/unlabeled_NNNNN.jpg`` (when
    ``unlabeled_fraction`` > 0), ``out/classes.toml``, ``out/synth.json`` (options, counts, the EXIF-rotated
    files, the deliberately broken ones with their kind and the withheld classes of the unlabelled photos).
    """
    from tqdm import tqdm

    opts = options or SynthOptions()
    if opts.per_class < 1 or not 32 <= opts.size <= 4096:  # 4096: a phone photo's side; far beyond, one image
        # alone would take gigabytes to draw
        raise ValueError(f"need per_class >= 1 and a size of 32 to 4096 px, got {opts.per_class}, {opts.size}")
    if not 0.0 <= opts.unlabeled_fraction < 1.0:
        raise ValueError(f"unlabeled_fraction must be at least 0 and below 1, got {opts.unlabeled_fraction}")
    if not 0.0 <= opts.exif_fraction <= 1.0:  # nan fails too
        raise ValueError(f"exif_fraction must be from 0 to 1, got {opts.exif_fraction}")
    if opts.broken < 0:
        raise ValueError(f"broken must be 0 or more (files made broken on purpose), got {opts.broken}")
    if opts.seed < 0:
        raise ValueError(f"seed must be 0 or more, got {opts.seed}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if unlabeled_counts(opts) >= opts.per_class:
        raise ValueError(f"unlabeled_fraction {opts.unlabeled_fraction} of {opts.per_class} photos per class "
                         "leaves no labelled photo in a class; lower it or raise per_class")
    out_p = Path(out).resolve()
    existing = None if force else _up_to_date(out_p, opts)
    if existing is not None:
        log(f"{out_p}: synthetic dataset up to date (same options); nothing to do")
        return existing
    check_replaceable(out_p, SYNTH_META, "synthetic dataset folder")
    t0 = time.perf_counter()
    out_p.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_dir(out_p)
    try:
        tasks = []
        withheld = _unlabeled_names(opts)
        if withheld:
            (tmp / UNLABELED_DIR).mkdir()
        for ci, cls in enumerate(CLASSES):
            (tmp / cls).mkdir()
            for i in range(opts.per_class):
                name = withheld.get((ci, i))
                dest = tmp / UNLABELED_DIR / name if name else tmp / cls / f"{cls}_{i:04d}.jpg"
                tasks.append((cls, ci, i, opts.size, opts.seed, str(dest), opts.exif_fraction))
        workers = max(1, workers or usable_cpus())
        rotated = []
        bar = tqdm(total=len(tasks), desc="synth", unit="img", disable=not progress)
        if workers > 1:
            with worker_pool(workers, initializer=_worker_init) as pool:
                results = list(r for r in pool.map(_render_task, tasks, chunksize=16) if not bar.update(1))
        else:
            results = [r for r in map(_render_task, tasks) if not bar.update(1)]
        bar.close()
        for path, orientation in results:
            if orientation != 1:
                rotated.append(RotatedFile(path=Path(path).relative_to(tmp).as_posix(), orientation=orientation))
        broken = _write_broken(tmp, opts)
        (tmp / CLASSES_TOML).write_text(classes_toml(), encoding="utf-8")
        meta = SynthInfo(generator="leaflens data synth", options=opts, classes=CLASSES,
                         images_per_class=opts.per_class, backgrounds=BACKGROUNDS, exif_rotated=tuple(rotated),
                         broken=tuple(broken),
                         unlabeled=tuple(UnlabeledFile(path=f"{UNLABELED_DIR}/{name}", withheld_class=CLASSES[ci])
                                         for (ci, _), name in sorted(withheld.items(), key=lambda kv: kv[1])))
        (tmp / SYNTH_META).write_text(json.dumps(meta.to_dict(), indent=2) + "\n", encoding="utf-8")
        swap_into_place(tmp, out_p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    unl = f", {len(withheld)} of them in {UNLABELED_DIR}/ with their labels withheld" if withheld else ""
    log(f"{out_p}: {len(tasks)} images in {len(CLASSES)} classes{unl} ({len(rotated)} EXIF-rotated, "
        f"{len(broken)} deliberately broken) in {time.perf_counter() - t0:.1f} s")
    return meta


def _write_broken(root: Path, opts: SynthOptions) -> list[BrokenFile]:
    """Deliberately broken files, named like the others, so ingest's rejection paths are exercised."""
    rng = np.random.default_rng([opts.seed, 99991])
    broken = []
    for k in range(opts.broken):
        cls = CLASSES[k % len(CLASSES)]
        kind = _BROKEN_KINDS[k % len(_BROKEN_KINDS)]
        path = root / cls / f"{cls}_{opts.per_class + k:04d}.jpg"
        if kind == "truncated":
            arr = render(cls, opts.size, rng)
            buf = Image.fromarray(arr)
            buf.save(path, "JPEG", quality=90)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        elif kind == "empty":
            path.write_bytes(b"")
        else:
            path.write_bytes(b"This is not a photo: a text file saved with a .jpg name.\n")
        broken.append(BrokenFile(path=path.relative_to(root).as_posix(), kind=kind))
    return broken
