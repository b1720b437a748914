"""The fine-tuned teacher as a model to serve: its weights, its preprocessing contract, ``teacher.onnx``.

When the teacher stage fine-tunes EfficientNet-Lite0 on the dataset (pipeline/teachers/effnet.py) it also
writes into the teacher folder:

- ``model.npz``: the whole fine-tuned network, an engine checkpoint whose ``extra`` is a
  :class:`TeacherModelMeta` (architecture, classes, preprocessing contract, the teacher's identity);
- ``teacher.onnx``: the network as `leaflens export` writes a student (the model card in its metadata,
  outputs ``logits`` and ``ood_score``), so ``leaflens serve --model <teacher>/teacher.onnx`` serves it.
  Its probabilities are calibrated on validation as a student's are (the temperature folded into its
  classifier; ``model.npz`` keeps the network as trained). It is written only when it matches the engine
  on the validation photos (the export's gates);
- ``teacher.json``'s ``stage.served`` (:class:`ServedTeacher`): what was written or why not, and the
  figures `leaflens distill` weighs the teacher by (parameters; validation and test accuracy).

The teacher's contract (:func:`teacher_contract`) decodes a photo exactly as the teacher stage did
(:func:`leaflens.pipeline.teachers.stage.iter_split_images`): at the teacher's input size straight from
the original photo, the shorter side first scaled to 256/224 of it ("crop" datasets), then normalised as
the ImageNet weights expect ((x - 127) / 128); at the dataset's own size, the stored pixels. A teacher
made ``--from-arrays`` saw upsampled stored arrays, which no decode of a photo reproduces: it is not
served (``stage.served`` says so).

The out-of-domain score is fitted as a student's (:func:`leaflens.pipeline.ood.fit_ood_head`, on the
training photos, thresholded on the validation photos), on the statistics of the stem and of every
stage's last block (:meth:`EfficientNetLite.forward_blocks`). onnxruntime computes them on a graph of
the network: the NumPy engine is about ten times slower at 224 px (the engine is used when onnxruntime
is missing, and for the parity check, on at most :data:`PARITY_PHOTOS` validation photos).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.apps.model_card import TIE_RATIO, ModelCard, unsure
from leaflens.data_prep.arrays import NpyRowWriter
from leaflens.data_prep.contract import PreprocessContract, rgb_floats
from leaflens.engine.checkpoint import CheckpointError, read_checkpoint_arrays, save_checkpoint
from leaflens.engine.nn import Module
from leaflens.extras import install_command
from leaflens.pipeline import calibration, ood
from leaflens.pipeline.models.efficientnet import IMAGENET_MEAN, IMAGENET_STD, EfficientNetLite
from leaflens.pipeline.report import metrics
from leaflens.pipeline.teachers.stage import iter_split_images
from leaflens.records import Record, RecordError

__all__ = ["MODEL_FILE", "ONNX_FILE", "PARITY_PHOTOS", "ServedTeacher", "TeacherModelMeta", "TeacherNotServable",
           "decode_split", "fit_teacher_ood", "load_teacher_model", "read_served", "split_batches",
           "teacher_contract", "write_served_teacher"]

MODEL_FILE = "model.npz"
ONNX_FILE = "teacher.onnx"
PARITY_PHOTOS = 64  # validation photos the engine checks teacher.onnx on here (0.1 s each at 224 px; export: all)
FP32_TOLERANCE = 1e-4  # max |logit difference| per unit of the largest |logit| (at least 1): the export's gate
OOD_TOLERANCE = 1e-3  # out-of-domain score difference relative to max(1, |score|): the export's gate


class TeacherNotServable(ValueError):
    """The teacher cannot be served as it was made (the message says why)."""


@dataclass(frozen=True)
class TeacherModelMeta(Record):
    """``model.npz``'s ``extra``: what rebuilds the fine-tuned teacher and how a photo reaches it."""

    architecture: dict[str, Any]      # EfficientNetLite.architecture()
    classes: tuple[str, ...]
    contract: PreprocessContract | None  # None: not servable (``reason``)
    teacher: dict[str, Any]           # teacher.json's identity entry
    dataset_manifest_sha256: str
    reason: str | None = None


@dataclass(frozen=True)
class ServedTeacher(Record):
    """teacher.json's ``stage.served``: the servable teacher, or why there is none.

    ``val_accuracy`` / ``test_accuracy`` are teacher.onnx's network in onnxruntime on the photos decoded by
    its contract; ``parity`` compares teacher.onnx with the engine on up to :data:`PARITY_PHOTOS`
    validation photos; ``ood`` is the out-of-domain check in its metadata."""

    written: bool                     # teacher.onnx is in the folder
    reason: str | None = None         # why it is not
    model: str | None = None          # MODEL_FILE when the network was saved
    onnx: str | None = None
    run_id: str | None = None
    params: int | None = None
    contract: PreprocessContract | None = None
    val_accuracy: float | None = None
    test_accuracy: float | None = None
    uncertain_threshold: float | None = None
    temperature: float | None = None  # teacher.onnx's logits are the network's divided by it (calibrated on val)
    parity: dict[str, Any] | None = None
    ood: dict[str, Any] | None = None
    seconds: float | None = None


def read_served(stage: dict[str, Any], where: str) -> ServedTeacher | None:
    """teacher.json's ``stage.served`` as a record (None for teachers made before it existed)."""
    data = stage.get("served")
    if data is None:
        return None
    try:
        return ServedTeacher.from_dict(data, f"{where}: stage.served")
    except RecordError as exc:
        raise TeacherNotServable(str(exc)) from None


def normalization_stats(normalization: str) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(mean, std) on the pixel/255 scale of :func:`leaflens.pipeline.models.efficientnet.normalize_images`:
    "tf" is (x - 127) / 128, i.e. mean 127/255 and std 128/255."""
    if normalization == "tf":
        return rgb_floats([127 / 255] * 3, "mean"), rgb_floats([128 / 255] * 3, "std")
    if normalization == "imagenet":
        return rgb_floats(IMAGENET_MEAN, "mean"), rgb_floats(IMAGENET_STD, "std")
    raise ValueError(f"unknown normalization {normalization!r}")


def teacher_contract(ds: Any, input_size: int, normalization: str = "tf", from_arrays: bool = False,
                     shorter_side: Callable[[int], int] | None = None) -> PreprocessContract:
    """The contract that gives a served teacher the pixels the teacher stage gave it (see the module
    docstring); :class:`TeacherNotServable` for a teacher that saw upsampled stored arrays."""
    from leaflens.pipeline.teachers.effnet import shorter_side as classic  # noqa: PLC0415

    mean, std = normalization_stats(normalization)
    resize = ds.manifest.resize
    if input_size == ds.image_size:  # the stage used the stored arrays: decoded straight to this size
        return PreprocessContract(stored_size=input_size, input_size=input_size, mean=mean, std=std, resize=resize)
    if from_arrays:
        raise TeacherNotServable(
            f"the teacher was made with --from-arrays: it saw the stored {ds.image_size} px arrays upsampled to "
            f"{input_size} px, which decoding a photo cannot reproduce; make it from the original photos to serve it")
    side = (shorter_side or classic)(input_size) if resize == "crop" else None
    return PreprocessContract(stored_size=input_size, input_size=input_size, mean=mean, std=std, resize=resize,
                              shorter_side=side)


def split_batches(ds: Any, split: str, contract: PreprocessContract, batch: int = 32) -> Iterator[np.ndarray]:
    """uint8 batches of a split's photos at the contract's stored size, decoded as the teacher stage did."""
    return iter_split_images(ds, split, contract.stored_size, contract.shorter_side, batch)


def decode_split(ds: Any, split: str, contract: PreprocessContract, folder: Path, batch: int = 32) -> np.ndarray:
    """A split's photos decoded by the contract into ``folder/<split>.npy`` (memory-mapped, read-only):
    random access for parity, calibration and timing without holding 224 px photos in memory."""
    path = Path(folder) / f"{split}.npy"
    s = contract.stored_size
    with NpyRowWriter(path, len(ds[split]), (s, s, 3), np.uint8) as w:
        for chunk in split_batches(ds, split, contract, batch):
            w.write(chunk)
    return np.load(path, mmap_mode="r", allow_pickle=False)


# ---- the network's outputs, by onnxruntime when it is there ------------------------------------------------
class _BlockStats(Module):
    """(logits, the statistics of every map the out-of-domain score reads): the graph that fits the score."""

    def __init__(self, net: EfficientNetLite) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Any) -> tuple[Any, ...]:
        logits, maps = self.net.forward_blocks(x)
        return (logits, *[ood.block_stats(m) for m in maps])


class StatsRunner:
    """(logits, per-map statistics) of normalised NHWC batches: onnxruntime on the exported graph, else the
    engine (:func:`leaflens.pipeline.ood.model_outputs`)."""

    def __init__(self, net: EfficientNetLite, input_size: int, threads: int | None = None) -> None:
        self.net = net.eval()
        self.session: Any = None
        try:
            import onnxruntime  # noqa: F401, PLC0415

            from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415
            from leaflens.pipeline.export.parity import cpu_session  # noqa: PLC0415
        except ImportError:
            return
        n_maps = len(net.stage_ends()) + 1
        graph = export_onnx(_BlockStats(net), (3, input_size, input_size),
                            output_name=("logits", *[f"stats{i}" for i in range(n_maps)]))
        from leaflens.cpus import usable_cpus  # noqa: PLC0415

        self.session = cpu_session(graph.SerializeToString(), threads or usable_cpus())

    @property
    def backend(self) -> str:
        return "onnxruntime" if self.session is not None else "engine"

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        if self.session is None:
            return ood.model_outputs(self.net, x, batch=len(x) or 1)
        out = self.session.run(None, {"input": np.ascontiguousarray(x.transpose(0, 3, 1, 2))})
        return out[0], list(out[1:])


def outputs_of(runner: StatsRunner, batches: Iterable[np.ndarray], contract: PreprocessContract,
               keep: int = 0) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(logits, per-map statistics, the first ``keep`` photos) of uint8 stored-size batches."""
    logits, stats, kept = [], [], []
    n_kept = 0
    for chunk in batches:
        lg, st = runner(contract.prepare(chunk))
        logits.append(lg)
        stats.append(st)
        if n_kept < keep:
            kept.append(chunk[:keep - n_kept])
            n_kept += len(kept[-1])
    if not logits:
        raise ValueError("no photos")
    s = contract.stored_size
    photos = np.concatenate(kept) if kept else np.zeros((0, s, s, 3), np.uint8)
    return np.concatenate(logits), [np.concatenate(m) for m in zip(*stats)], photos


def fit_teacher_ood(runner: StatsRunner, contract: PreprocessContract, train: Iterable[np.ndarray],
                    train_labels: np.ndarray, val: Iterable[np.ndarray], num_classes: int,
                    budget: float = ood.DEFAULT_BUDGET, keep_val: int = 0
                    ) -> tuple[ood.OODHead, Any, np.ndarray, np.ndarray]:
    """The out-of-domain score fitted on the training photos and thresholded on the validation photos (as
    :func:`leaflens.pipeline.ood.fit_for_dataset` does for a student). Returns the head, the check, the
    validation logits and the first ``keep_val`` validation photos."""
    _, train_stats, _ = outputs_of(runner, train, contract)
    val_logits, val_stats, photos = outputs_of(runner, val, contract, keep_val)
    head, check, _ = ood.fit_ood_head(train_stats, np.asarray(train_labels), val_stats, num_classes, budget)
    return head, check, val_logits, photos


# ---- model.npz ---------------------------------------------------------------------------------------------
def save_teacher_model(path: Path, net: EfficientNetLite, meta: TeacherModelMeta) -> Path:
    """The whole fine-tuned network and its record, atomically."""
    return save_checkpoint(path, net, extra=meta.to_dict())


def load_teacher_model(path: str | Path) -> tuple[EfficientNetLite, TeacherModelMeta]:
    """The network of a ``model.npz`` in eval mode, and its record; CheckpointError naming the file."""
    path = Path(path)
    meta, arrays = read_checkpoint_arrays(path)
    try:
        record = TeacherModelMeta.from_dict(meta.get("extra", {}), str(path))
    except RecordError as exc:
        raise CheckpointError(f"{path} is not a teacher model written by `leaflens teacher`: {exc}") from None
    try:
        # initial values from a fixed generator: the checkpoint's weights replace all of them
        net = EfficientNetLite.from_architecture(record.architecture, np.random.default_rng(0))
        net.load_state_dict({k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")})
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: its weights do not fit the architecture it records: {exc}") from exc
    return net.eval(), record


# ---- the teacher stage's part --------------------------------------------------------------------------------
def _accuracy(logits: np.ndarray, labels: Any) -> float:
    return float(np.mean(logits.argmax(1) == np.asarray(labels)))


def check_against_engine(served: Module, session: Any, photos: np.ndarray, contract: PreprocessContract,
                         batch: int = 16) -> tuple[dict[str, Any], list[str]]:
    """teacher.onnx vs the engine on the same normalised photos: the export's figures and its failed gates."""
    from leaflens.pipeline.export import parity  # noqa: PLC0415

    mean, std = np.asarray(contract.mean, np.float32), np.asarray(contract.std, np.float32)
    logits, scores = parity.engine_and_onnx_outputs(served, {"fp32": session}, photos, mean, std, batch)
    tie = 2 * parity.relative_tolerance(FP32_TOLERANCE, float(np.abs(logits["engine"]).max()))
    figures = parity.compare(logits["engine"], logits["fp32"], tie)
    diff = np.abs(scores["fp32"].astype(np.float64) - scores["engine"])
    figures["ood_max_rel_diff"] = float((diff / np.maximum(1.0, np.abs(scores["engine"]))).max())
    failures = [why] if (why := parity.fp32_failure(figures, FP32_TOLERANCE)) is not None else []
    if figures["disagreements"] - figures["ties"] > 0:
        failures.append(f"top-1 agreement {figures['top1_agreement']:.2%}")
    if figures["ood_max_rel_diff"] > OOD_TOLERANCE:
        failures.append(f"out-of-domain score differs by {figures['ood_max_rel_diff']:.3g} (relative) > "
                        f"{OOD_TOLERANCE:g}")
    return figures, failures


def write_served_teacher(folder: Path, net: EfficientNetLite, ds: Any, identity: dict[str, Any],
                         from_arrays: bool = False, batch: int = 32,
                         log: Callable[[str], None] = lambda s: None) -> ServedTeacher:
    """Write ``model.npz`` and, when it can be served, ``teacher.onnx`` into ``folder`` (the teacher folder
    being built); returns teacher.json's ``stage.served``. Never raises for a teacher that cannot be served:
    the features are the stage's product, the served teacher a candidate distill may keep."""
    from leaflens.data_prep.manifest import manifest_sha256  # noqa: PLC0415

    t0 = time.perf_counter()
    folder = Path(folder)
    size = int(identity["input_size"])
    reason = None
    contract = None
    try:
        contract = teacher_contract(ds, size, net.config.normalization, from_arrays)
    except TeacherNotServable as exc:
        reason = str(exc)
    meta = TeacherModelMeta(architecture=net.architecture(), classes=tuple(ds.classes), contract=contract,
                            teacher=identity, dataset_manifest_sha256=manifest_sha256(ds.root), reason=reason)
    save_teacher_model(folder / MODEL_FILE, net, meta)
    params = int(net.num_parameters())

    def not_written(why: str, **more: Any) -> ServedTeacher:
        log(f"teacher.onnx not written: {why}")
        return ServedTeacher(written=False, reason=why, model=MODEL_FILE, params=params, contract=contract,
                             seconds=round(time.perf_counter() - t0, 1), **more)

    if contract is None:
        return not_written(str(reason))
    for split in ("train", "val"):
        if split not in ds or not len(ds[split]) or ds[split].labels is None:
            return not_written(f"dataset {ds.root} has no labelled '{split}' photos to fit its out-of-domain check on")
    try:
        import onnx  # noqa: F401, PLC0415
        import onnxruntime  # noqa: F401, PLC0415
    except ImportError as exc:
        return not_written(f"{exc.name or 'onnx'} is not installed ({install_command('serve')})")

    try:
        return _write_onnx(folder, net, ds, contract, params, batch, log, t0)
    except Exception as exc:  # noqa: BLE001 - onnx/onnxruntime raise their own types; the features stand regardless
        return not_written(f"exporting teacher.onnx failed: {type(exc).__name__}: {exc}")


def _write_onnx(folder: Path, net: EfficientNetLite, ds: Any, contract: PreprocessContract, params: int, batch: int,
                log: Callable[[str], None], t0: float) -> ServedTeacher:
    """The part of :func:`write_served_teacher` that needs onnx and onnxruntime: fit, export, check, write."""
    from leaflens.cpus import usable_cpus  # noqa: PLC0415
    from leaflens.engine.onnx_export import export_onnx, save_onnx  # noqa: PLC0415
    from leaflens.pipeline.export.parity import cpu_session  # noqa: PLC0415

    size, threads = contract.input_size, usable_cpus()
    log(f"served teacher: fitting its out-of-domain check on the training photos at {size} px")
    runner = StatsRunner(net, size, threads)
    head, check, val_logits, photos = fit_teacher_ood(
        runner, contract, split_batches(ds, "train", contract, batch), np.asarray(ds["train"].labels),
        split_batches(ds, "val", contract, batch), ds.num_classes, keep_val=PARITY_PHOTOS)
    val_labels = np.asarray(ds["val"].labels)
    test_acc = None
    if "test" in ds and len(ds["test"]) and ds["test"].labels is not None:
        test_logits, _, _ = outputs_of(runner, split_batches(ds, "test", contract, batch), contract)
        test_acc = _accuracy(test_logits, ds["test"].labels)
    # served calibrated, as a student is (leaflens.pipeline.calibration); model.npz keeps the network as trained
    temperature = calibration.fit_temperature(val_logits, val_labels)
    probs = metrics.softmax(val_logits / temperature)
    choice = metrics.choose_uncertain_threshold(probs, val_labels)
    threshold = float(choice["threshold"])
    run_id = f"teacher-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    card = ModelCard(classes=tuple(ds.classes), contract=contract, uncertain_threshold=threshold,
                     threshold_from_model=True, run_id=run_id, accuracy=test_acc, params=params, ood=check,
                     val_ambiguous=float(np.mean(unsure(probs, threshold))), tie_ratio=TIE_RATIO,
                     temperature=None if temperature == 1.0 else temperature)
    with calibration.scaled_classifier(net, temperature):
        served = ood.ServedModel(net, head)
        proto = export_onnx(served, (3, size, size), output_name=("logits", ood.OOD_OUTPUT),
                            metadata=card.to_metadata(), graph_name="leaflens_teacher",
                            doc_string=f"leaflens teacher: EfficientNet-Lite0 fine-tuned on {ds.root} ({run_id})")
        session = cpu_session(proto.SerializeToString(), threads)
        log(f"served teacher: checking teacher.onnx against the engine on {len(photos)} validation photos")
        figures, failures = check_against_engine(served, session, photos, contract)
    figures["split"] = "val"
    if failures:
        why = "teacher.onnx does not match the engine: " + "; ".join(failures)
        log(f"teacher.onnx not written: {why}")
        return ServedTeacher(written=False, reason=why, model=MODEL_FILE, params=params, contract=contract,
                             parity=figures, seconds=round(time.perf_counter() - t0, 1))
    save_onnx(proto, folder / ONNX_FILE)
    return ServedTeacher(written=True, model=MODEL_FILE, onnx=ONNX_FILE, run_id=run_id, params=params,
                         contract=contract, val_accuracy=_accuracy(val_logits, val_labels), test_accuracy=test_acc,
                         uncertain_threshold=threshold, temperature=temperature, parity=figures,
                         ood={**check.to_dict(), "backend": runner.backend},
                         seconds=round(time.perf_counter() - t0, 1))
