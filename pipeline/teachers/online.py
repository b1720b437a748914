"""The teacher in the student's training loop: targets for exactly the view the student is shown.

"A good teacher is patient and consistent" (Beyer et al. 2022): distillation reaches its teacher when the
teacher judges the very image the student sees, a fresh crop every time, over a long schedule. Cached
targets (one per photo) and a view bank (``K`` views per photo, pipeline/teachers/views.py) approximate
that; with ``distill.teacher_online = true`` the fine-tuned teacher's network (``model.npz`` in the teacher
folder) runs on every batch instead. Each photo of a batch gets a random-resized crop and flips drawn from a
generator seeded by (seed, epoch, batch), so a resumed run draws the same views; the view is cut from the
stored array twice, at the student's input size and at the teacher's (upsampled when the dataset is stored
smaller than the teacher's input, so the teacher sees the pixels the student's array holds), after the same
colour jitter, and with mixup both views are mixed with the same draw: the targets belong to the mixed
image, nothing is mixed afterwards.

On a CPU the teacher runs in onnxruntime on a graph of the network (the NumPy engine when onnxruntime is
missing), 13-22 ms per photo at 160 px on a shared 2-core machine (plus about 6 ms to cut the view): on
iBeans the 60-epoch student took 29 min on 2 threads against 20 min on 1 thread with cached targets.
With ``train.device = "cuda"`` it runs in the engine on the GPU, the place it is meant for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from leaflens.engine import Tensor, no_grad
from leaflens.engine.backend import to_device
from leaflens.engine.data import Augment, apply_view_boxes, sample_view_boxes
from leaflens.engine.nn import Module
from leaflens.pipeline.models.efficientnet import EfficientNetLite, normalize_images

__all__ = ["OnlineTeacher", "TeacherOnlineError", "load_online_teacher", "view_boxes"]


class TeacherOnlineError(ValueError):
    """The teacher folder cannot run in the training loop (the message says why and what to do)."""


class _LogitsAndFeatures(Module):
    """(logits, pooled features): the two targets, as one graph to export."""

    def __init__(self, net: EfficientNetLite) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Any) -> tuple[Any, Any]:
        logits, feats = self.net.forward_with_features(x)
        return logits, feats


def view_boxes(n: int, aug: Augment, seed: int, epoch: int, batch: int) -> np.ndarray:
    """One random-resized crop + flips per row, ``(n, 6)`` (:func:`leaflens.engine.data.sample_view_boxes`),
    from a generator of its own per (seed, epoch, batch): a resumed run cuts the same views."""
    rng = np.random.default_rng([seed, epoch, batch, 0x7E])
    return sample_view_boxes(n, 2, aug, rng)[:, 1]  # view 0 is always the plain photo: take view 1


class OnlineTeacher:
    """The fine-tuned teacher as a function of the student's batch: ``(features, logits)`` float32 on the host
    for views of normalised stored-size images."""

    def __init__(self, net: EfficientNetLite, input_size: int, normalization: str, device: str = "cpu",
                 threads: int | None = None, batch: int = 64) -> None:
        self.net = net.eval()
        self.input_size, self.normalization, self.device, self.batch = int(input_size), normalization, device, batch
        self.feature_dim = int(net.feature_dim)
        self.session: Any = None
        if device != "cpu":
            self.net.to(device)
            return
        try:
            import onnxruntime  # noqa: F401, PLC0415

            from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415
            from leaflens.pipeline.export.parity import cpu_session  # noqa: PLC0415
        except ImportError:
            return
        from leaflens.cpus import usable_cpus  # noqa: PLC0415

        graph = export_onnx(_LogitsAndFeatures(self.net), (3, self.input_size, self.input_size),
                            output_name=("logits", "features"))
        self.session = cpu_session(graph.SerializeToString(), threads or usable_cpus())

    @property
    def backend(self) -> str:
        if self.device != "cpu":
            return f"engine on {self.device}"
        return "onnxruntime" if self.session is not None else "engine"

    def teacher_views(self, x: np.ndarray, mean: np.ndarray, std: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """The teacher's input for ``boxes`` of a batch normalised with the dataset's ``mean``/``std``
        (pixel/255 scale): back to pixels, cut at the teacher's size, normalised as its weights expect."""
        pixels = (np.asarray(x, np.float32) * (np.asarray(std, np.float32) * 255.0)
                  + np.asarray(mean, np.float32) * 255.0)
        views = apply_view_boxes(pixels, boxes, self.input_size)
        return normalize_images(np.clip(views, 0.0, 255.0), self.normalization)

    def __call__(self, views: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(features (N, D), logits (N, C)) of teacher-normalised NHWC views."""
        feats, logits = [], []
        for i in range(0, len(views), self.batch):
            chunk = np.ascontiguousarray(views[i:i + self.batch], np.float32)
            if self.session is not None:
                lg, f = self.session.run(None, {"input": np.ascontiguousarray(chunk.transpose(0, 3, 1, 2))})
            else:
                with no_grad():
                    lt, ft = self.net.forward_with_features(Tensor(to_device(chunk, self.device)))
                lg, f = to_device(lt.data, "cpu"), to_device(ft.data, "cpu")
            feats.append(np.asarray(f, np.float32))
            logits.append(np.asarray(lg, np.float32))
        return np.concatenate(feats), np.concatenate(logits)

    def accuracy(self, images: Any, labels: np.ndarray, mean: np.ndarray, std: np.ndarray, batch: int = 64) -> float:
        """Accuracy on whole stored-size photos (uint8 NHWC): what the teacher is worth at the pixels it sees
        in this mode (its own decode of the original photos may be sharper)."""
        from leaflens.data_prep.contract import normalize  # noqa: PLC0415

        plain = np.zeros((1, 6), np.float32)
        plain[0, 2:4] = 1.0
        right = 0
        for i in range(0, len(images), batch):
            x = normalize(np.asarray(images[i:i + batch]), mean, std)
            _, logits = self(self.teacher_views(x, mean, std, np.repeat(plain, len(x), 0)))
            right += int((logits.argmax(1) == np.asarray(labels[i:i + batch])).sum())
        return right / max(len(images), 1)


def load_online_teacher(root: Path, num_classes: int, feature_dim: int, device: str = "cpu",
                        threads: int | None = None) -> OnlineTeacher:
    """The network of the teacher folder ``root`` (its ``model.npz``), checked against the targets the
    folder's features promise; :class:`TeacherOnlineError` naming the folder otherwise."""
    from leaflens.engine.checkpoint import CheckpointError  # noqa: PLC0415
    from leaflens.pipeline.teachers.served import MODEL_FILE, load_teacher_model  # noqa: PLC0415

    path = Path(root) / MODEL_FILE
    if not path.is_file():
        raise TeacherOnlineError(
            f"distill.teacher_online needs the teacher's network, {path}, which `leaflens teacher` writes when it "
            "fine-tunes EfficientNet-Lite0; this teacher folder has none (features from a file or an ONNX encoder "
            "cannot run in the loop): set distill.teacher_online = false")
    try:
        net, meta = load_teacher_model(path)
    except CheckpointError as exc:
        raise TeacherOnlineError(str(exc)) from None
    identity = meta.teacher
    size = int(identity.get("input_size") or (meta.contract.input_size if meta.contract else 0))
    normalization = str(identity.get("normalization", "tf"))
    if size < 1:
        raise TeacherOnlineError(f"{path} records no input size for its network")
    if len(meta.classes) != num_classes or net.feature_dim != feature_dim:
        raise TeacherOnlineError(
            f"{path} has {len(meta.classes)} classes and {net.feature_dim}-d features, but the teacher's cached "
            f"targets have {num_classes} and {feature_dim}: the folder is inconsistent, run `leaflens teacher` again")
    return OnlineTeacher(net, size, normalization, device=device, threads=threads)
