"""The doctor's measurements: the largest safe training batch for a student and an input size, and
every fact ``leaflens doctor`` reports (:func:`collect`; the command in leaflens.pipeline.cli.doctor prints it),
the GPU stacks and the install extra for the driver among them (leaflens.pipeline.gpu_stacks).

The batch size is derived from the peak memory of real training steps (forward, backward, optimiser
step) measured at two small batches: the two peaks give a fixed cost (weights, optimiser state,
workspace) and a cost per image, and the largest batch is the one whose predicted peak stays within
80 % of the free memory (20 % is left as a margin for fragmentation, the CUDA context and libraries).
On a GPU the peak is CuPy's memory pool after the step (emptied before it), plus the loader's two
device batch buffers. On a CPU-only machine the same fit runs on the Python/NumPy heap peak
(``tracemalloc``) against the RAM the kernel reports available, and is labelled for what it is: a
memory ceiling, while on a CPU the batch size is limited by speed long before memory.

A recipe's student family (``[model] family``, leaflens.pipeline.models.family) trains every member with
the same ``train.batch_size``, so :func:`collect_family` sizes each member at its own widths, block kind and
input size, and reports the smallest safe batch with the member it comes from: the one the batch must fit.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from leaflens.pipeline.gpu_stacks import gpu_stack_facts
from leaflens.pipeline.hardware import available_ram_bytes, cpu_facts, gpu_facts, software_facts

if TYPE_CHECKING:
    from leaflens.pipeline.config import ModelSection
    from leaflens.pipeline.models.student import StudentSpec

SAFETY = 0.8  # use at most 80 % of the free memory: 20 % stays free as a margin
GPU_BATCHES = (16, 64)  # measured on a GPU (large enough that the pool's rounding does not dominate)
CPU_BATCHES = (2, 8)    # measured on the CPU (cheap)
SIZED_BLOCKS = ("conv", "separable", "lite0")  # the student kinds _training_step builds


class BatchEstimateUnavailable(RuntimeError):
    """The peak memory of a training step cannot be measured here (says why)."""


@dataclass(frozen=True)
class ModelSpec:
    """The student to size a batch for: conv widths, block kind, classes, precision (what ``leaflens distill``
    trains)."""

    widths: tuple[int, ...]  # the default recipe's come from its [model] section (default_spec)
    num_classes: int = 10
    mixed_precision: str = "auto"  # "auto" (on with a GPU), "on", "off": as train.mixed_precision
    source: str = "defaults"       # where the numbers came from (defaults, options, a run folder)
    configured_batch: int | None = None  # train.batch_size of that recipe or run
    block: str = "conv"  # as [model] block; "separable" blocks have far fewer weights; "lite0": a pretrained trunk
    trunk_blocks: int | None = None  # block "lite0": EfficientNet-Lite0 blocks in the trunk (widths[-1]: its head)

    def student_spec(self) -> StudentSpec:
        """The :class:`~leaflens.pipeline.models.student.StudentSpec` distill would build for this spec (random
        weights: a pretrained student needs the memory of its architecture, not its ImageNet values)."""
        from leaflens.pipeline.models.student import StudentSpec  # noqa: PLC0415

        if self.block == "lite0":
            return StudentSpec(num_classes=self.num_classes, widths=(self.widths[-1],), kind="lite0_trunk",
                               trunk_blocks=self.trunk_blocks or 8)
        return StudentSpec(num_classes=self.num_classes, widths=tuple(self.widths),
                           block="separable" if self.block == "separable" else None)

    def describe(self) -> str:
        if self.block == "lite0":
            return (f"student Lite0 trunk of {self.trunk_blocks} blocks, head {self.widths[-1]}, "
                    f"{self.num_classes} classes")
        return (f"student CNN widths {'-'.join(map(str, self.widths))}"
                f"{', separable' if self.block == 'separable' else ''}, {self.num_classes} classes")


@dataclass(frozen=True)
class MemberSpec:
    """One student of a family to size: the member's name, its architecture and the input side it trains at."""

    name: str
    spec: ModelSpec
    input_size: int


def default_spec() -> ModelSpec:
    """The student of the default recipe (pipeline/distill_default.toml)."""
    from leaflens.pipeline.config import load_config  # noqa: PLC0415

    cfg = load_config()
    return ModelSpec(widths=cfg.model.widths, mixed_precision=cfg.train.mixed_precision,
                     configured_batch=cfg.train.batch_size, block=cfg.model.block,
                     trunk_blocks=cfg.model.trunk_blocks if cfg.model.block == "lite0" else None)


def family_specs(model: ModelSection, base: ModelSpec) -> list[MemberSpec]:
    """Every member ``model.family`` lists (leaflens.pipeline.models.family.members), as ``base`` with the
    member's widths and block kind, at the member's input size: its ``@PX``, else ``model.input_size``
    (64 where that is 0, the dataset's stored size: no dataset is given to read it from)."""
    from leaflens.pipeline.models.family import members  # noqa: PLC0415

    out = []
    for m in members(model):
        lite = m.model.block == "lite0"  # a pretrained trunk: its one width is its head's
        out.append(MemberSpec(m.name, replace(base, widths=(m.model.widths[-1],) if lite else tuple(m.model.widths),
                                              block=m.model.block, trunk_blocks=m.model.trunk_blocks if lite else None),
                              m.model.input_size or 64))
    return out


def spec_from_run(run_dir: str | os.PathLike[str]) -> tuple[ModelSpec, int]:
    """(model, input size) of a trained run folder: widths and classes from best.npz, the recipe's batch
    size and precision from its config.toml when present."""
    from leaflens.pipeline.config import read_toml  # noqa: PLC0415
    from leaflens.pipeline.runs import read_run  # noqa: PLC0415

    info = read_run(run_dir)
    mc = info.model_config  # the kept student's architecture, separable blocks included
    block = (mc.block or "conv") if mc.kind == "student_cnn" else "lite0" if mc.kind == "lite0_trunk" else str(mc.kind)
    cfg_path = Path(run_dir) / "config.toml"
    train = read_toml(cfg_path).get("train", {}) if cfg_path.exists() else {}
    spec = ModelSpec(widths=mc.widths, num_classes=mc.num_classes,
                     mixed_precision=str(train.get("mixed_precision", "auto")), source=str(run_dir),
                     configured_batch=int(train["batch_size"]) if "batch_size" in train else None,
                     block=block, trunk_blocks=mc.trunk_blocks)
    return spec, info.dataset.model_input_size


def _as_spec(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if model == "student":
        return default_spec()
    raise BatchEstimateUnavailable(f"unknown model {model!r}: only the student CNN can be sized")


def _use_amp(spec: ModelSpec, device: str) -> bool:
    from leaflens.pipeline.train_student import resolve_precision  # noqa: PLC0415

    return resolve_precision(spec.mixed_precision, device)


def _training_step(spec: ModelSpec, input_size: int, batch: int, device: str) -> Callable[[], None]:
    """One real training step of the student (AdamW, cross-entropy, mixed precision as the spec says)
    on random data that lives on ``device``: the training loop's own step (leaflens.engine.amp.train_step)."""
    from leaflens.engine import Tensor, ops  # noqa: PLC0415
    from leaflens.engine.amp import GradScaler, train_step  # noqa: PLC0415
    from leaflens.engine.optim import AdamW  # noqa: PLC0415

    if spec.block not in SIZED_BLOCKS:
        raise BatchEstimateUnavailable(f"a {spec.block!r} student cannot be sized: the doctor builds "
                                       f"{' or '.join(SIZED_BLOCKS)} students")
    use_amp = _use_amp(spec, device)
    model = spec.student_spec().build(np.random.default_rng(0))
    if device != "cpu":
        model.to(device)
    opt = AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(enabled=use_amp)
    shape = (batch, input_size, input_size, 3)
    if device == "cpu":
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape, dtype=np.float32)
        y = rng.integers(0, spec.num_classes, batch)
    else:
        import cupy as cp  # noqa: PLC0415

        x = cp.random.standard_normal(shape, dtype=cp.float32)
        y = cp.random.randint(0, spec.num_classes, batch)

    def step() -> None:
        train_step(opt, scaler, lambda: ops.cross_entropy(model(Tensor(x)), y))

    return step


def loader_buffer_bytes(input_size: int, batch: int) -> int:
    """Device memory of DeviceLoader's two batch buffers (float32 images, int64 labels)."""
    return 2 * batch * (input_size * input_size * 3 * 4 + 8)


def measure_train_step_peak_bytes(model: ModelSpec | str, input_size: int, batch: int) -> int:
    """Peak GPU memory (bytes) of one forward + backward + optimiser step of ``model`` on a batch of
    ``batch`` RGB images of ``input_size`` x ``input_size``, measured, not computed.

    A warm-up step first (optimiser state, cuBLAS workspace, kernel compilation); then CuPy's memory
    pool is emptied of cached blocks, one more step runs, and the pool's size right after it is the
    high-water mark (blocks freed during the step stay cached in the pool, so the pool only grows when
    the step needs more at once). The loader's two device buffers are added. Raises
    BatchEstimateUnavailable without a usable GPU.
    """
    from leaflens.engine.device_loader import gpu_usable  # noqa: PLC0415

    ok, why = gpu_usable()
    if not ok:
        raise BatchEstimateUnavailable(f"no usable GPU: {why}")
    import cupy as cp  # noqa: PLC0415

    spec = _as_spec(model)
    pool = cp.get_default_memory_pool()
    step = _training_step(spec, input_size, batch, "cuda")
    try:
        step()
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        step()
        cp.cuda.Device().synchronize()
        peak = int(pool.total_bytes())
    except cp.cuda.memory.OutOfMemoryError as exc:
        raise BatchEstimateUnavailable(f"out of GPU memory at batch {batch}: {exc}") from exc
    finally:
        del step
        gc.collect()
        pool.free_all_blocks()
    return peak + loader_buffer_bytes(input_size, batch)


def measure_cpu_step_peak_bytes(model: ModelSpec | str, input_size: int, batch: int) -> int:
    """Peak Python/NumPy heap growth (bytes) of one CPU training step, measured with ``tracemalloc``
    (NumPy reports its array buffers to it), after a warm-up step that allocates the optimiser state."""
    spec = _as_spec(model)
    step = _training_step(spec, input_size, batch, "cpu")
    step()
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        step()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return int(peak)


def largest_safe_batch(samples: list[tuple[int, int]], free_bytes: int, safety: float = SAFETY) -> int:
    """Largest batch whose predicted peak fits ``safety * free_bytes``.

    ``samples`` are measured (batch, peak_bytes) pairs at two or more batch sizes; peak memory is
    modelled as ``fixed + per_sample * batch`` (weights, optimiser state and workspace are fixed;
    activations grow with the batch), fitted by least squares. Returns 0 if not even one sample fits.
    """
    if len(samples) < 2 or len({b for b, _ in samples}) < 2:
        raise ValueError("largest_safe_batch needs peak measurements at two or more different batch sizes")
    if not 0 < safety <= 1:
        raise ValueError(f"safety must be in (0, 1], got {safety}")
    b = np.array([s[0] for s in samples], dtype=np.float64)
    m = np.array([s[1] for s in samples], dtype=np.float64)
    per_sample, fixed = np.polyfit(b, m, 1)
    if per_sample < 1.0:  # under a byte per sample: flat (or shrinking) peaks, nothing to extrapolate
        raise ValueError(f"peak memory does not grow with the batch ({samples}); cannot extrapolate")
    budget = safety * free_bytes - fixed
    return max(0, int(np.floor(budget / per_sample + 1e-6)))  # + 1e-6: least-squares rounding, not memory


def batch_estimate(
    model: ModelSpec | str,
    input_size: int,
    free_bytes: int,
    measure: Callable[[Any, int, int], int] = measure_train_step_peak_bytes,
    batches: tuple[int, int] = GPU_BATCHES,
    safety: float = SAFETY,
) -> dict[str, Any]:
    """{"batch", "samples", "free_bytes", "safety", "per_image_bytes"} from measured peaks, or
    {"unavailable": reason}."""
    try:
        samples = [(b, int(measure(model, input_size, b))) for b in batches]
        batch = largest_safe_batch(samples, free_bytes, safety)
    except (BatchEstimateUnavailable, ValueError) as exc:
        return {"unavailable": str(exc)}
    (b0, p0), (b1, p1) = samples[0], samples[-1]
    return {"batch": batch, "samples": samples, "free_bytes": int(free_bytes), "safety": safety,
            "per_image_bytes": (p1 - p0) / (b1 - b0)}


CPU_SPEED_NOTE = ("a memory ceiling, not a recommendation: on the CPU the batch size is limited by speed, not "
                  "memory (a step's time grows with its batch)")


def cpu_batch_estimate(spec: ModelSpec, input_size: int,
                       measure: Callable[[Any, int, int], int] = measure_cpu_step_peak_bytes) -> dict[str, Any]:
    """The memory ceiling for a CPU batch (measured heap peaks vs available RAM), with the speed caveat."""
    return _cpu_batch_estimate(spec, input_size, available_ram_bytes(), measure)


def _cpu_batch_estimate(spec: ModelSpec, input_size: int, ram: int | None,
                        measure: Callable[[Any, int, int], int] = measure_cpu_step_peak_bytes) -> dict[str, Any]:
    if ram is None:
        return {"unavailable": "available RAM unknown on this system", "note": CPU_SPEED_NOTE}
    est = batch_estimate(spec, input_size, ram, measure=measure, batches=CPU_BATCHES)
    est["note"] = CPU_SPEED_NOTE
    return est


def gpu_batch_estimate(model: ModelSpec | str, input_size: int, free_bytes: int) -> dict[str, Any]:
    """The batch estimate against the GPU's free memory; smaller probe batches when the usual ones do not
    fit (a small GPU or a large input)."""
    est = batch_estimate(model, input_size, free_bytes)
    if "out of GPU memory" in est.get("unavailable", ""):
        est = batch_estimate(model, input_size, free_bytes, batches=CPU_BATCHES)
    return est


def limiting_member(estimates: Sequence[dict[str, Any]]) -> int:
    """Index of the estimate the family's training batch must fit: the first one that is unavailable (that
    member could not be sized, so neither can the family), else the smallest safe batch (the first listed
    on a tie)."""
    if not estimates:
        raise ValueError("limiting_member needs at least one estimate")
    for i, est in enumerate(estimates):
        if "batch" not in est:
            return i
    return min(range(len(estimates)), key=lambda i: estimates[i]["batch"])


def extras_facts() -> dict[str, Any]:
    """What the optional extras give here: the EfficientNet-Lite0 weights (the default teacher's, and the lite
    students' start; ``lite0_weights``: their file, None when missing), gradio (the web app) and pillow-heif
    (HEIC photos), as versions (None: not installed)."""
    from importlib import metadata  # noqa: PLC0415

    from leaflens.pipeline.models import pretrained  # noqa: PLC0415

    def installed(dist: str) -> str | None:  # from the package's metadata: importing gradio takes seconds
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    try:
        weights: str | None = str(pretrained.find_lite0_weights())
    except (pretrained.WeightsNotFoundError, OSError):
        weights = None
    return {"lite0_weights": weights, "gradio": installed("gradio"), "pillow_heif": installed("pillow-heif")}


def _request(member: MemberSpec, device: str) -> dict[str, Any]:
    spec = member.spec
    req = {"model": "student", "input_size": member.input_size, "widths": list(spec.widths),
           "num_classes": spec.num_classes, "mixed_precision": _use_amp(spec, device),
           "source": spec.source, "configured_batch": spec.configured_batch}
    if spec.block != "conv":  # absent for plain conv blocks, as in a run's model_config
        req["block"] = spec.block
    if spec.trunk_blocks is not None:
        req["trunk_blocks"] = spec.trunk_blocks
    return req


def collect(model: ModelSpec | str, input_size: int, measure_bandwidth: bool = True,
            measure_batch: bool = True) -> dict[str, Any]:
    """Every fact the report shows for one student, as one JSON-able dict (``--json`` prints it as it is)."""
    return collect_family([MemberSpec("student", _as_spec(model), input_size)], measure_bandwidth, measure_batch)


def collect_family(family: Sequence[MemberSpec], measure_bandwidth: bool = True,
                   measure_batch: bool = True) -> dict[str, Any]:
    """Every fact the report shows, as one JSON-able dict (``--json`` prints it as it is), sizing every member
    of ``family`` against the same free memory. ``request`` and the batch estimate are the limiting member's
    (:func:`limiting_member`); with more than one member, ``request["member"]`` names it and ``family`` lists
    each member's request and estimate. One member gives exactly the facts of :func:`collect`."""
    if not family:
        raise ValueError("collect_family needs at least one member")
    gpu = gpu_facts(measure_bandwidth)
    device = "cuda" if gpu["available"] else "cpu"
    if not measure_batch:
        unmeasured = {"unavailable": "not measured (--no-measure)"}
        estimates = [dict(unmeasured) if gpu["available"] else {**unmeasured, "note": CPU_SPEED_NOTE}
                     for _ in family]
    elif gpu["available"]:
        estimates = [gpu_batch_estimate(m.spec, m.input_size, gpu["free_bytes"]) for m in family]
    else:  # CPU-only: the memory ceiling of a CPU batch, with its caveat; one RAM reading for every member
        ram = available_ram_bytes()
        estimates = [_cpu_batch_estimate(m.spec, m.input_size, ram) for m in family]
    limit = limiting_member(estimates)
    if gpu["available"]:
        gpu["batch_estimate"] = estimates[limit]
    facts: dict[str, Any] = {
        "software": {**software_facts(), **extras_facts()},
        "cpu": cpu_facts(),
        "gpu": gpu,
        "gpu_stacks": gpu_stack_facts(),
        "request": _request(family[limit], device),
    }
    if not gpu["available"]:
        facts["cpu_batch_estimate"] = estimates[limit]
    if len(family) > 1:
        facts["request"]["member"] = family[limit].name
        facts["family"] = [{"member": m.name, **_request(m, device), "batch_estimate": est}
                           for m, est in zip(family, estimates)]
    return facts


def gpu_requirement_failure(facts: dict[str, Any]) -> str | None:
    """Why :func:`collect`'s facts do not show a usable GPU (``leaflens doctor --require-gpu`` exits 1 with this
    line), naming the CUDA libraries CuPy misses and the install command for this driver; None with a GPU."""
    gpu = facts["gpu"]
    if gpu["available"]:
        return None
    line = f"no usable GPU: {gpu['reason']}"
    stacks = facts.get("gpu_stacks") or {}
    missing = (stacks.get("cupy") or {}).get("missing") or []
    if missing:
        line += f" (missing: {', '.join(missing)})"
    install = stacks.get("install") or {}
    if install.get("extra"):
        line += f"; for this driver: {install['command']}"
    return line
