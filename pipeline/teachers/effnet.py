"""The default teacher: ImageNet EfficientNet-Lite0, partially fine-tuned on the dataset by the engine.

Frozen ImageNet features are weaker on leaf photos than a small CNN trained from scratch (measured:
iBeans linear probe 87.5 % vs about 95 %), and a teacher weaker than its student teaches nothing.
So by default the teacher first learns the task. To fit a CPU budget the network is cut before
block ``k``: the front (stem + early blocks) runs once per image with its ImageNet weights and its
output is cached (plain and mirrored views of the training photos); only the back (the last blocks,
the head conv and a new classifier) is trained on that cache, with a low learning rate for the
pretrained layers and a higher one for the new classifier, selecting the epoch on the validation
split. The cached fronts then give every split's features (1280-d) and logits. The recipe (cut
point, input size, epochs, learning rates...) is the ``[teacher]`` section of the stage config.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from leaflens.engine import NonFiniteLossError, Tensor, no_grad, ops
from leaflens.engine.nn import set_dropout_generator
from leaflens.engine.optim import AdamW, WarmupCosine, clip_grad_norm_
from leaflens.pipeline.config import TeacherSection
from leaflens.pipeline.models.efficientnet import EfficientNetLite, LiteConfig, normalize_images
from leaflens.pipeline.models.pretrained import find_lite0_weights, load_efficientnet_lite0
from leaflens.pipeline.teachers.stage import ArrayEncoder, iter_split_images


def shorter_side(size: int) -> int:
    """The classic ImageNet evaluation crop: shorter side to 256/224 of the input size, then centre crop."""
    return round(size * 256 / 224)


class FrontRunner:
    """The frozen front, run by onnxruntime on the graph our exporter makes of it (several times faster
    than the NumPy engine at 224x224); the engine itself when onnxruntime is not installed."""

    def __init__(self, front: Any, input_size: int):
        self.front = front
        self.input_size = input_size
        self.session = None
        try:
            import onnxruntime as ort  # noqa: PLC0415

            from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415
        except ImportError:
            return
        graph = export_onnx(front, (3, input_size, input_size), output_name="front")
        self.session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])

    @property
    def backend(self) -> str:
        return "onnxruntime" if self.session is not None else "engine"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Normalised NHWC float32 -> NHWC front output."""
        if self.session is None:
            with no_grad():
                return self.front(Tensor(x)).numpy()
        (h,) = self.session.run(None, {"input": np.ascontiguousarray(x.transpose(0, 3, 1, 2))})
        return h.transpose(0, 2, 3, 1)


def _run_front(front: FrontRunner, ds: Any, split: str, normalization: str, batch: int, from_arrays: bool,
               mirror: bool, bar: tqdm) -> tuple[np.ndarray, np.ndarray | None]:
    """Front outputs (N, h, w, c) float16 for a split, and for its mirrored images when asked."""
    plain, flipped = [], []
    size = front.input_size
    for chunk in iter_split_images(ds, split, size, shorter_side(size), batch, from_arrays):
        x = normalize_images(chunk, normalization)
        plain.append(front(x).astype(np.float16))
        if mirror:
            flipped.append(front(np.ascontiguousarray(x[:, :, ::-1])).astype(np.float16))
        bar.update(len(chunk))
    return np.concatenate(plain), (np.concatenate(flipped) if mirror else None)


def _back_outputs(back: Any, h: np.ndarray, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    feats, logits = [], []
    back.eval()
    with no_grad():
        for i in range(0, len(h), batch):
            lg, f = back.forward_with_features(Tensor(h[i:i + batch].astype(np.float32)))
            feats.append(f.numpy())
            logits.append(lg.numpy())
    return np.concatenate(feats), np.concatenate(logits)


class EffnetImageEncoder:
    """The teacher as a function of pixels (front in onnxruntime, back in the engine): for view banks."""

    sees_images = True

    def __init__(self, front: FrontRunner, back: Any, normalization: str, feature_dim: int,
                 num_classes: int | None):
        self.front, self.back, self.normalization = front, back, normalization
        self.input_size, self.feature_dim, self.num_classes = front.input_size, feature_dim, num_classes

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        h = self.front(normalize_images(images, self.normalization)).astype(np.float16)  # as the cache holds it
        feats, logits = _back_outputs(self.back, h)
        return feats, (logits if self.num_classes else None)


def build_effnet_teacher(ds: Any, teacher: TeacherSection, weights_file: str | Path | None = None,
                         from_arrays: bool = False, progress: bool = True) -> tuple[ArrayEncoder, dict]:
    """The EfficientNet-Lite0 teacher for ``ds``, fine-tuned by the ``[teacher]`` recipe unless it says
    ``frozen`` (or the dataset has no labelled train split); ``weights_file`` None: the installed weights."""
    cfg = LiteConfig(padding="same", bn_eps=1e-3, normalization="tf")
    weights = find_lite0_weights(weights_file)
    net: EfficientNetLite = load_efficientnet_lite0(weights, cfg)
    frozen = teacher.frozen or "train" not in ds or ds["train"].labels is None
    k = teacher.finetune_from_block
    if not frozen:
        # A generator of its own from the recipe's seed, not a stream shared with whatever ran before in this
        # process: the new head's initial weights alone moved the fine-tuned teacher's iBeans test accuracy
        # by several points.
        net.reset_classifier(ds.num_classes, np.random.default_rng(teacher.seed))
    front_module, back = net.split(k)
    size = teacher.input_size
    front = FrontRunner(front_module.eval(), size)
    t0 = time.perf_counter()
    mirror = teacher.mirror and not frozen
    total = sum(len(ds[s]) * (2 if (s == "train" and mirror) else 1) for s in ds.splits)
    bar = tqdm(total=total, desc=f"teacher: EfficientNet-Lite0 blocks 0-{k - 1} (frozen)", unit="img",
               disable=not progress)
    fronts: dict[str, np.ndarray] = {}
    mirrored = None
    for split in ds.splits:
        fronts[split], m = _run_front(front, ds, split, cfg.normalization, teacher.encode_batch_size, from_arrays,
                                      mirror=(split == "train" and mirror), bar=bar)
        if m is not None:
            mirrored = m
    bar.close()
    front_seconds = time.perf_counter() - t0
    extra: dict[str, Any] = {"weights": str(weights), "config": cfg.to_dict(), "split_block": k,
                             "front_backend": front.backend,
                             "front_seconds": round(front_seconds, 1), "fine_tuned": not frozen}
    identity = {"kind": "efficientnet-lite0", "weights": str(weights), "fine_tuned": not frozen, "split_block": k,
                "input_size": size, "shorter_side": shorter_side(size), "padding": cfg.padding,
                "normalization": cfg.normalization, "bn_eps": cfg.bn_eps}
    if frozen:
        feats = {s: _back_outputs(back, h)[0] for s, h in fronts.items()}
        enc = ArrayEncoder(feats, None, weights, ds.image_size, identity)
    else:
        extra.update(_fine_tune(back, fronts, mirrored, ds, teacher, progress=progress))
        outs = {s: _back_outputs(back, h) for s, h in fronts.items()}
        enc = ArrayEncoder({s: o[0] for s, o in outs.items()}, {s: o[1] for s, o in outs.items()}, weights,
                           ds.image_size, identity)
    enc.view_encoder = EffnetImageEncoder(front, back, cfg.normalization, enc.feature_dim, enc.num_classes)
    return enc, extra


def _fine_tune(back: Any, fronts: dict[str, np.ndarray], mirrored: np.ndarray | None, ds: Any,
               teacher: TeacherSection, progress: bool) -> dict:
    """Train the back on cached front outputs of the train split; keep the best epoch on val."""
    epochs, batch, seed = teacher.epochs, teacher.batch_size, teacher.seed
    set_dropout_generator(back, np.random.default_rng(seed))  # the head's dropout masks
    rng = np.random.default_rng(seed)
    y = np.asarray(ds["train"].labels)
    yv = np.asarray(ds["val"].labels)
    views = [fronts["train"]] + ([mirrored] if mirrored is not None else [])
    head = {id(p) for p in back.fc.parameters()}
    groups = [{"params": [p for p in back.parameters() if id(p) not in head], "lr": teacher.lr},
              {"params": back.fc.parameters(), "lr": teacher.head_lr}]
    opt = AdamW(groups, lr=teacher.lr, weight_decay=teacher.weight_decay)
    steps = max(len(y) // batch, 1)
    sched = WarmupCosine(opt, total_steps=epochs * steps,
                         warmup_steps=min(teacher.warmup_epochs * steps, epochs * steps))
    best = (-1.0, -1, None)
    history = []
    t_start = time.perf_counter()
    for epoch in range(epochs):
        back.train()
        order = rng.permutation(len(y))
        view = rng.integers(0, len(views), len(y))
        t0 = time.perf_counter()
        losses = []
        bar = tqdm(range(steps), desc=f"teacher fine-tune epoch {epoch + 1}/{epochs}", leave=False,
                   disable=not progress)
        for s in bar:
            idx = order[s * batch:(s + 1) * batch]
            h = np.stack([views[v][i] for v, i in zip(view[idx], idx)]).astype(np.float32)
            opt.zero_grad()
            try:
                loss = ops.cross_entropy(back(Tensor(h)), y[idx], label_smoothing=teacher.label_smoothing)
                loss.backward()
            except NonFiniteLossError:
                continue
            clip_grad_norm_(back.parameters(), teacher.clip_grad_norm)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if epoch == 0 and s == 1 and progress:
                per_step = (time.perf_counter() - t0) / 2
                tqdm.write(f"teacher fine-tuning: about {per_step * steps * epochs / 60:.1f} min for {epochs} epochs")
        _, val_logits = _back_outputs(back, fronts["val"])
        val_acc = float((val_logits.argmax(1) == yv).mean())
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)) if losses else None, "val_acc": val_acc,
                        "seconds": round(time.perf_counter() - t0, 1)})
        if progress:
            tqdm.write(f"teacher epoch {epoch + 1}/{epochs}: loss {history[-1]['loss']:.4f} val acc {val_acc:.4f}")
        if val_acc > best[0]:
            best = (val_acc, epoch + 1, {k: v.copy() for k, v in back.state_dict().items()})
    back.load_state_dict(best[2])
    return {"fine_tune_history": history, "fine_tune_best_epoch": best[1], "fine_tune_val_acc": best[0],
            "fine_tune_seconds": round(time.perf_counter() - t_start, 1)}
