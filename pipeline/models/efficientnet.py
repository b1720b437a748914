"""EfficientNet-Lite (Lite0 by default) as an engine Module, NHWC, loadable from the PyTorch state dict.

EfficientNet-Lite is EfficientNet without squeeze-excitation, with ReLU6 instead of swish, and with
the stem (32) and head (1280) widths fixed. The network:

    stem conv 3x3 stride 2 -> BN -> ReLU6
    MBConv blocks: [expand 1x1 -> BN -> ReLU6] -> depthwise kxk (stride) -> BN -> ReLU6 -> project 1x1 -> BN
                   (+ identity skip when stride 1 and in == out channels)
    head conv 1x1 -> BN -> ReLU6 -> global average pool (1280-d features) -> dropout -> fc (logits)

Everything but the strides is read from the weight shapes (channels, expansion, kernel sizes); the
strides are those of EfficientNet-B0, one per stage (a stage = a run of blocks ending in the same
width). All convolutions are bias-free and followed by BatchNorm, as in the checkpoint;
:meth:`EfficientNetLite.fused` returns a copy with BatchNorm folded into the convolutions for
inference and export.

Options that change the numbers (measured in benchmarks/teacher_parity.py; record them with the
features): ``padding`` "same" (TensorFlow's, asymmetric for stride 2; what the weights were trained
with) or "symmetric" (k // 2 on every side); ``bn_eps`` (1e-3 as in TensorFlow); and the input
normalisation applied by :func:`normalize_images`: "tf" ((x - 127) / 128) or "imagenet" (mean/std).

Partial fine-tuning: :meth:`EfficientNetLite.split` cuts the network before block ``k`` into a
front (stem + blocks[:k], to run once with frozen weights) and a back (blocks[k:] + head + fc, to
train); both share the parent's parameters.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from leaflens.engine import nn, ops

__all__ = ["B0_STAGE_STRIDES", "NORMALIZATIONS", "PADDINGS", "BlockSpec", "EfficientNetBack", "EfficientNetFront",
           "EfficientNetLite", "FeatureEncoder", "LiteConfig", "map_torch_state_dict", "normalize_images",
           "specs_from_state_dict", "tf_input_affine"]

# Stride of each of EfficientNet-B0's seven stages (shared by every Lite variant).
B0_STAGE_STRIDES = (1, 2, 2, 2, 1, 2, 1)
PADDINGS = ("same", "symmetric")
NORMALIZATIONS = ("tf", "imagenet")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@dataclass(frozen=True)
class BlockSpec:
    """One MBConv block: input/output channels, expanded (hidden) channels, kernel size, stride."""

    cin: int
    cout: int
    hidden: int  # == cin when there is no expansion conv (expand ratio 1)
    kernel: int
    stride: int

    @property
    def expand(self) -> bool:
        return self.hidden != self.cin

    @property
    def skip(self) -> bool:
        return self.stride == 1 and self.cin == self.cout


@dataclass(frozen=True)
class LiteConfig:
    """Numerical choices that the weights do not fix (see the module docstring)."""

    padding: str = "same"
    bn_eps: float = 1e-3
    bn_momentum: float = 0.01  # PyTorch convention (TensorFlow's decay 0.99)
    normalization: str = "tf"
    dropout: float = 0.2
    image_size: int = 224

    def __post_init__(self) -> None:
        if self.padding not in PADDINGS:
            raise ValueError(f"padding must be one of {PADDINGS}, got {self.padding!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if not self.bn_eps > 0:
            raise ValueError(f"bn_eps must be positive, got {self.bn_eps!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def normalize_images(images: np.ndarray, normalization: str = "tf") -> np.ndarray:
    """uint8 (or 0..255 float) NHWC RGB -> float32 network input.

    "tf": (x - 127) / 128, the EfficientNet-Lite TensorFlow convention; "imagenet": (x / 255 - mean) / std.
    """
    x = np.asarray(images, dtype=np.float32)
    if x.shape[-1] != 3:
        raise ValueError(f"normalize_images expects NHWC RGB (last axis 3), got shape {x.shape}")
    if normalization == "tf":
        return (x - 127.0) / 128.0
    if normalization == "imagenet":
        return (x / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def tf_input_affine(mean: Any, std: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (scale, shift), float32, that turn an input normalised as ``(pixel/255 - mean) / std``
    (``mean``, ``std`` on the [0, 1] scale) into the "tf" normalisation Lite0's weights expect: ``(pixel - 127)
    / 128 = x * 255 std / 128 + (255 mean - 127) / 128``."""
    m, s = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    return (255.0 * s / 128.0).astype(np.float32), ((255.0 * m - 127.0) / 128.0).astype(np.float32)


def _conv_padding(config: LiteConfig, kernel: int) -> Any:
    return "same" if config.padding == "same" else kernel // 2


class MBConv(nn.Module):
    """Inverted residual block without squeeze-excitation (EfficientNet-Lite)."""

    def __init__(self, spec: BlockSpec, config: LiteConfig, fold_bn: bool = False, *,
                 rng: np.random.Generator | None = None):
        super().__init__()
        self.spec = spec

        def bn(c: int) -> nn.Module:
            return nn.Identity() if fold_bn else nn.BatchNorm2d(c, eps=config.bn_eps, momentum=config.bn_momentum)

        if spec.expand:
            self.expand_conv = nn.Conv2d(spec.cin, spec.hidden, 1, bias=fold_bn, rng=rng)
            self.bn0 = bn(spec.hidden)
        self.depthwise_conv = nn.Conv2d(spec.hidden, spec.hidden, spec.kernel, stride=spec.stride,
                                        padding=_conv_padding(config, spec.kernel), groups=spec.hidden, bias=fold_bn,
                                        rng=rng)
        self.bn1 = bn(spec.hidden)
        self.project_conv = nn.Conv2d(spec.hidden, spec.cout, 1, bias=fold_bn, rng=rng)
        self.bn2 = bn(spec.cout)

    def forward(self, x: Any) -> Any:
        h = x
        if self.spec.expand:
            h = ops.relu6(self.bn0(self.expand_conv(h)))
        h = ops.relu6(self.bn1(self.depthwise_conv(h)))
        h = self.bn2(self.project_conv(h))
        return h + x if self.spec.skip else h

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.cin}->{s.hidden}->{s.cout}, k={s.kernel}, stride={s.stride}, skip={s.skip}"


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite on NHWC float32 input (normalised with :func:`normalize_images`).

    ``rng`` gives the initial weights and the dropout masks (see :mod:`leaflens.engine.random`); the
    constructors that load weights (:meth:`from_torch_state_dict`, :meth:`fused`) replace every initial
    value, and a fine-tune points the dropout at its own generator.
    """

    def __init__(self, blocks: Sequence[BlockSpec], num_classes: int = 1000, stem_channels: int = 32,
                 head_channels: int = 1280, config: LiteConfig | None = None, in_channels: int = 3,
                 fold_bn: bool = False, *, rng: np.random.Generator | None = None):
        super().__init__()
        if not blocks:
            raise ValueError("EfficientNetLite needs at least one block")
        self.config = config or LiteConfig()
        self.specs = list(blocks)
        self.num_classes, self.stem_channels, self.head_channels = num_classes, stem_channels, head_channels
        self.in_channels, self.folded = in_channels, fold_bn
        for i, (a, b) in enumerate(zip([stem_channels] + [s.cout for s in self.specs], self.specs)):
            if b.cin != a:
                raise ValueError(f"block {i} takes {b.cin} channels but receives {a}")
        cfg = self.config

        def bn(c: int) -> nn.Module:
            return nn.Identity() if fold_bn else nn.BatchNorm2d(c, eps=cfg.bn_eps, momentum=cfg.bn_momentum)

        self.stem_conv = nn.Conv2d(in_channels, stem_channels, 3, stride=2, padding=_conv_padding(cfg, 3),
                                   bias=fold_bn, rng=rng)
        self.stem_bn = bn(stem_channels)
        self.blocks = nn.Sequential(*[MBConv(s, cfg, fold_bn, rng=rng) for s in self.specs])
        self.head_conv = nn.Conv2d(self.specs[-1].cout, head_channels, 1, bias=fold_bn, rng=rng)
        self.head_bn = bn(head_channels)
        self.pool = nn.GlobalAvgPool2d()
        self.dropout = nn.Dropout(cfg.dropout, rng=rng) if cfg.dropout else nn.Identity()
        self.fc = nn.Linear(head_channels, num_classes, rng=rng)

    # ---- forward pieces ---------------------------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        return self.head_channels

    @property
    def num_blocks(self) -> int:
        return len(self.specs)

    @property
    def classifier(self) -> nn.Linear:
        """The last layer, by the name the students give it (``fc`` here, as in the published weights)."""
        return self.fc

    def stem(self, x: Any) -> Any:
        return ops.relu6(self.stem_bn(self.stem_conv(x)))

    def run_blocks(self, h: Any, start: int = 0, stop: int | None = None) -> Any:
        for block in list(self.blocks)[start:stop]:
            h = block(h)
        return h

    def head(self, h: Any) -> Any:
        """Last block's output -> (N, head_channels) pooled features."""
        return self.pool(ops.relu6(self.head_bn(self.head_conv(h))))

    def features(self, x: Any) -> Any:
        """Normalised NHWC images -> (N, 1280) pooled features (before dropout and the classifier)."""
        return self.head(self.run_blocks(self.stem(x)))

    def classify(self, feats: Any) -> Any:
        return self.fc(self.dropout(feats))

    def forward(self, x: Any) -> Any:
        return self.classify(self.features(x))

    def forward_with_features(self, x: Any) -> tuple[Any, Any]:
        """(logits, pooled features) in one pass."""
        f = self.features(x)
        return self.classify(f), f

    def stage_ends(self) -> list[int]:
        """Indices of the last block of each stage (a run of blocks ending in the same width)."""
        return [i for i, s in enumerate(self.specs) if i + 1 == len(self.specs) or self.specs[i + 1].cout != s.cout]

    def forward_blocks(self, x: Any) -> tuple[Any, list[Any]]:
        """(logits, feature maps the out-of-domain score reads: the stem's (before its ReLU6) and the last
        block's output of every stage), from the same pass that gives the answer (leaflens.pipeline.ood).

        The stem and the stage ends span colour and texture (early) to object parts (late), as the student's
        conv blocks do. Every map is taken before a clipping activation (a stage ends in a linear projection):
        a channel ReLU6 holds at 0 or 6 on every training photo has no spread, and the score's whitening
        would divide by it (1e7 on a small dataset, beyond float16). The head conv is left out: its 1280
        channels would give 2560 statistics, whose whitening matrix (26 MB) would double an exported Lite0 and
        be estimated from a few hundred photos.
        """
        pre = self.stem_bn(self.stem_conv(x))
        h = ops.relu6(pre)
        maps = [pre]
        ends = set(self.stage_ends())
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i in ends:
                maps.append(h)
        return self.classify(self.head(h)), maps

    # ---- partial fine-tuning ----------------------------------------------------------------------
    def split(self, k: int) -> tuple[EfficientNetFront, EfficientNetBack]:
        """Cut before block ``k`` (0 <= k <= num_blocks): front = stem + blocks[:k], back = the rest.

        Typical use: run the front once over the dataset in eval mode under ``no_grad`` and cache its
        output (:meth:`split_shape` gives its shape), then train ``back.parameters()`` on the cache.
        """
        if not 0 <= k <= self.num_blocks:
            raise ValueError(f"split point must be in 0..{self.num_blocks}, got {k}")
        return EfficientNetFront(self, k), EfficientNetBack(self, k)

    def split_shape(self, k: int, image_size: int | None = None) -> tuple[int, int, int]:
        """(H, W, C) of the front's output for square input of ``image_size`` (default config.image_size).

        Every kernel is odd, so 'same' and symmetric (k // 2) padding both give ceil(size / stride).
        """
        size = image_size or self.config.image_size
        for s in [2] + [b.stride for b in self.specs[:k]]:
            size = -(-size // s)
        channels = self.specs[k - 1].cout if k else self.stem_channels
        return size, size, channels

    def reset_classifier(self, num_classes: int, rng: np.random.Generator) -> None:
        """Replace the 1000-class ImageNet classifier by one freshly initialised from ``rng``."""
        self.num_classes = num_classes
        self.fc = nn.Linear(self.head_channels, num_classes, rng=rng)

    # ---- building and loading ---------------------------------------------------------------------
    def architecture(self) -> dict[str, Any]:
        """JSON-friendly description (with :meth:`from_architecture`, rebuilds the same network)."""
        return {"kind": "efficientnet_lite", "blocks": [asdict(s) for s in self.specs],
                "num_classes": self.num_classes, "stem_channels": self.stem_channels,
                "head_channels": self.head_channels, "in_channels": self.in_channels,
                "config": self.config.to_dict(), "folded": self.folded}

    @classmethod
    def from_architecture(cls, arch: Mapping[str, Any], rng: np.random.Generator | None = None) -> EfficientNetLite:
        return cls([BlockSpec(**b) for b in arch["blocks"]], num_classes=int(arch["num_classes"]),
                   stem_channels=int(arch["stem_channels"]), head_channels=int(arch["head_channels"]),
                   config=LiteConfig(**arch["config"]), in_channels=int(arch.get("in_channels", 3)),
                   fold_bn=bool(arch.get("folded", False)), rng=rng)

    @classmethod
    def from_torch_state_dict(cls, state: Mapping[str, np.ndarray], config: LiteConfig | None = None,
                              strides: Sequence[int] | None = None, source: str = "state dict") -> EfficientNetLite:
        """Build the network the state dict describes and load it (strict; see :func:`map_torch_state_dict`)."""
        specs, stem, head, classes = specs_from_state_dict(state, strides, source)
        model = cls(specs, num_classes=classes, stem_channels=stem, head_channels=head, config=config,
                    in_channels=int(np.asarray(state["_conv_stem.weight"]).shape[1]),
                    rng=np.random.default_rng(0))  # every initial value is replaced by the state dict's
        model.load_state_dict(map_torch_state_dict(state, model, source))
        return model.eval()

    def fused(self) -> EfficientNetLite:
        """A copy for inference with every BatchNorm folded into the convolution before it (eval statistics)."""
        if self.folded:
            raise ValueError("this network is already folded")
        out = type(self)(self.specs, num_classes=self.num_classes, stem_channels=self.stem_channels,
                         head_channels=self.head_channels, config=self.config, in_channels=self.in_channels,
                         fold_bn=True, rng=np.random.default_rng(0))  # every initial value is replaced below
        state: dict[str, np.ndarray] = {}
        pairs = [("stem_conv", "stem_bn"), ("head_conv", "head_bn")]
        for i, spec in enumerate(self.specs):
            if spec.expand:
                pairs.append((f"blocks.{i}.expand_conv", f"blocks.{i}.bn0"))
            pairs += [(f"blocks.{i}.depthwise_conv", f"blocks.{i}.bn1"),
                      (f"blocks.{i}.project_conv", f"blocks.{i}.bn2")]
        own = self.state_dict()
        for conv, bn in pairs:
            w = own[f"{conv}.weight"].astype(np.float64)
            eps = self.config.bn_eps
            scale = own[f"{bn}.weight"] / np.sqrt(own[f"{bn}.running_var"].astype(np.float64) + eps)
            state[f"{conv}.weight"] = (w * scale[:, None, None, None]).astype(np.float32)
            state[f"{conv}.bias"] = (own[f"{bn}.bias"] - own[f"{bn}.running_mean"] * scale).astype(np.float32)
        state["fc.weight"], state["fc.bias"] = own["fc.weight"], own["fc.bias"]
        out.load_state_dict(state)
        return out.train(self.training)


class EfficientNetFront(nn.Module):
    """stem + blocks[:k] of an EfficientNetLite (shares its parameters)."""

    def __init__(self, net: EfficientNetLite, k: int):
        super().__init__()
        object.__setattr__(self, "_net", net)  # not a child: the parent's own tree stays the owner
        self.k = k
        self.stem_conv, self.stem_bn = net.stem_conv, net.stem_bn
        self.blocks = nn.Sequential(*list(net.blocks)[:k])

    def forward(self, x: Any) -> Any:
        return self.blocks(self._net.stem(x))


class EfficientNetBack(nn.Module):
    """blocks[k:] + head + classifier of an EfficientNetLite (shares its parameters).

    ``forward`` gives logits and ``features`` the pooled features. Call
    :meth:`EfficientNetLite.reset_classifier` before splitting: the back holds the classifier it saw.
    """

    def __init__(self, net: EfficientNetLite, k: int):
        super().__init__()
        object.__setattr__(self, "_net", net)
        self.k = k
        self.blocks = nn.Sequential(*list(net.blocks)[k:])
        self.head_conv, self.head_bn, self.dropout, self.fc = net.head_conv, net.head_bn, net.dropout, net.fc

    def features(self, h: Any) -> Any:
        return self._net.head(self.blocks(h))

    def forward(self, h: Any) -> Any:
        return self.fc(self.dropout(self.features(h)))

    def forward_with_features(self, h: Any) -> tuple[Any, Any]:
        f = self.features(h)
        return self.fc(self.dropout(f)), f


# ---- PyTorch state-dict mapping -------------------------------------------------------------------------
_BLOCK_KEY = re.compile(r"^_blocks\.(\d+)\.")
_TOP = {"_conv_stem": "stem_conv", "_bn0": "stem_bn", "_conv_head": "head_conv", "_bn1": "head_bn", "_fc": "fc"}
_IN_BLOCK = {"_expand_conv": "expand_conv", "_bn0": "bn0", "_depthwise_conv": "depthwise_conv", "_bn1": "bn1",
             "_project_conv": "project_conv", "_bn2": "bn2"}


def _shape(state: Mapping[str, np.ndarray], key: str, source: str, ndim: int) -> tuple[int, ...]:
    if key not in state:
        raise KeyError(f"{source}: missing key {key!r}")
    shape = tuple(np.shape(state[key]))
    if len(shape) != ndim:
        raise ValueError(f"{source}: {key!r} has shape {shape}, expected {ndim} dimensions")
    return shape


def specs_from_state_dict(state: Mapping[str, np.ndarray], strides: Sequence[int] | None = None,
                          source: str = "state dict") -> tuple[list[BlockSpec], int, int, int]:
    """(block specs, stem channels, head channels, classes) read from the weight shapes.

    ``strides``: one per block; by default EfficientNet-B0's stage strides, a stage being a run of
    blocks with the same output width (requires the seven stages of every EfficientNet).
    """
    se = [k for k in state if "_se_" in k]
    if se:
        raise ValueError(f"{source}: has squeeze-excitation weights ({se[0]!r}, ...): this is a full EfficientNet, "
                         f"not EfficientNet-Lite, which this module builds")
    nblocks = 1 + max((int(m.group(1)) for k in state if (m := _BLOCK_KEY.match(k))), default=-1)
    if nblocks == 0:
        raise KeyError(f"{source}: no '_blocks.N.' keys: not an EfficientNet state dict")
    stem = _shape(state, "_conv_stem.weight", source, 4)[0]
    raw = []
    for i in range(nblocks):
        p = f"_blocks.{i}."
        dw = _shape(state, p + "_depthwise_conv.weight", source, 4)
        if dw[1] != 1 or dw[2] != dw[3]:
            raise ValueError(f"{source}: {p}_depthwise_conv.weight has shape {dw}, expected (C, 1, k, k)")
        hidden = dw[0]
        cin = _shape(state, p + "_expand_conv.weight", source, 4)[1] if p + "_expand_conv.weight" in state else hidden
        cout = _shape(state, p + "_project_conv.weight", source, 4)[0]
        raw.append((cin, cout, hidden, dw[2]))
    if strides is None:
        stage_of, stage = [], -1
        for i, r in enumerate(raw):
            if i == 0 or r[1] != raw[i - 1][1]:
                stage += 1
            stage_of.append(stage)
        if stage + 1 != len(B0_STAGE_STRIDES):
            raise ValueError(f"{source}: {stage + 1} stages (runs of equal block width), not the "
                             f"{len(B0_STAGE_STRIDES)} of EfficientNet-B0: pass the per-block strides explicitly")
        strides = [B0_STAGE_STRIDES[s] if i == 0 or stage_of[i - 1] != s else 1 for i, s in enumerate(stage_of)]
    if len(strides) != nblocks:
        raise ValueError(f"{source}: {len(strides)} strides given for {nblocks} blocks")
    specs = [BlockSpec(cin, cout, hidden, k, int(s)) for (cin, cout, hidden, k), s in zip(raw, strides)]
    head = _shape(state, "_conv_head.weight", source, 4)[0]
    classes = _shape(state, "_fc.weight", source, 2)[0]
    return specs, stem, head, classes


def map_torch_state_dict(state: Mapping[str, np.ndarray], model: EfficientNetLite,
                         source: str = "state dict") -> OrderedDict[str, np.ndarray]:
    """Rename PyTorch keys to the engine model's, strictly: every key used, every shape checked.

    ``*.num_batches_tracked`` counters have no engine counterpart; they are checked to be integer
    scalars and dropped.
    """
    own = model.state_dict()
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for key, value in state.items():
        value = np.asarray(value)
        if key.endswith(".num_batches_tracked"):
            if value.shape != () or value.dtype.kind not in "iu":
                raise ValueError(f"{source}: {key!r} should be an integer scalar, got {value.dtype} {value.shape}")
            continue
        m = _BLOCK_KEY.match(key)
        module, _, leaf = (key[m.end():] if m else key).partition(".")
        table = _IN_BLOCK if m else _TOP
        if module not in table or not leaf:
            raise KeyError(f"{source}: unexpected key {key!r} (not part of EfficientNet-Lite)")
        name = f"blocks.{m.group(1)}.{table[module]}.{leaf}" if m else f"{table[module]}.{leaf}"
        if name not in own:
            raise KeyError(f"{source}: key {key!r} (engine name {name!r}) has no place in the model")
        if value.shape != own[name].shape:
            raise ValueError(f"{source}: {key!r} has shape {value.shape}, the model expects {own[name].shape}")
        if value.dtype.kind != "f":
            raise ValueError(f"{source}: {key!r} has dtype {value.dtype}, expected floating point")
        out[name] = value.astype(np.float32)
    missing = [k for k in own if k not in out]
    if missing:
        raise KeyError(f"{source}: no value for {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return out



class FeatureEncoder(nn.Module):
    """``forward`` = the wrapped network's pooled features, for the ONNX exporter (which traces ``forward``
    and records one output): ``export_onnx(FeatureEncoder(net), (3, 224, 224), output_name="features")``.
    """

    def __init__(self, net: EfficientNetLite):
        super().__init__()
        self.net = net

    def forward(self, x: Any) -> Any:
        return self.net.features(x)
