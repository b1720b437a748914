"""``leaflens doctor``: what this machine offers leaflens.

Prints the Python/NumPy/CuPy/onnxruntime versions, the CPU facts (cores, CPU quota, BLAS in use), the GPU
stacks (the NVIDIA driver's CUDA version; CuPy and onnxruntime: built for which CUDA, whether each starts
and which library it misses; the install extra for this driver), and
either "no GPU: <reason>" or the GPU's name, compute capability, total/free memory, the host-to-device
bandwidth measured with pinned memory, and the largest safe training batch for a model and input
size (``--widths``/``--size``, or read from a trained run with ``--run``): for every member of the recipe's
student family (``--family s,m,l``), reporting the member that limits the batch; ``--require-gpu`` makes a machine
without a usable GPU exit 1 with the reason (``make gpu-check`` runs it). The facts come from
leaflens.pipeline.doctor (the batch-size measurement) and leaflens.pipeline.hardware (the probes); this
module parses the options and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from leaflens.cpus import THREADS_ENV
from leaflens.extras import install_command
from leaflens.pipeline.cli import path_arg
from leaflens.pipeline.doctor import (
    MemberSpec,
    ModelSpec,
    collect_family,
    default_spec,
    family_specs,
    gpu_requirement_failure,
    spec_from_run,
)


# ---- report ----------------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class _Lines:
    rows: list[str]

    def add(self, key: str, value: Any) -> None:
        self.rows.append(f"  {key:<22} {value}")


def _student(req: dict[str, Any]) -> str:
    """``student 32-64-128-256 at 64x64`` (``, separable`` for depthwise-separable blocks; ``student Lite0
    blocks 0-7 + 256 head at 64x64`` for a pretrained trunk)."""
    size = f"at {req['input_size']}x{req['input_size']}"
    if req.get("block") == "lite0":
        return f"student Lite0 blocks 0-{req['trunk_blocks'] - 1} + {req['widths'][-1]} head {size}"
    return (f"student {'-'.join(map(str, req.get('widths', [])))}"
            f"{', separable' if req.get('block') == 'separable' else ''} {size}")


def _estimate_lines(out: _Lines, est: dict[str, Any], req: dict[str, Any], memory: str) -> None:
    member = f"family member {req['member']}, " if "member" in req else ""
    what = f"{member}{_student(req)}{', mixed precision' if req.get('mixed_precision') else ', float32'}"
    if "unavailable" in est:
        out.add("largest safe batch", f"batch-size estimate unavailable: {est['unavailable']}")
        return
    measured = ", ".join(f"batch {b}: {_mib(p)}" for b, p in est["samples"])
    out.add("largest safe batch", f"{est['batch']} for {what}")
    out.add("  from", f"measured peaks {measured}; {_mib(est['per_image_bytes'])} per image; "
                      f"{est['safety']:.0%} of {_gib(est['free_bytes'])} {memory}")
    configured = req.get("configured_batch")
    if configured:
        verdict = "fits" if configured <= est["batch"] else "does NOT fit: lower train.batch_size"
        out.add("  recipe batch", f"{configured} ({verdict})")


def _family_lines(out: _Lines, facts: dict[str, Any]) -> None:
    """Each member's largest safe batch, when the recipe's family has more than one member; the batch above
    is the limiting member's, since every member trains with the same train.batch_size."""
    family = facts.get("family")
    if not family:
        return
    limit = facts["request"]["member"]
    limit_est = next(m["batch_estimate"] for m in family if m["member"] == limit)
    names = ", ".join(m["member"] for m in family)
    if "batch" in limit_est:
        out.add("family", f"{names}: the training batch must fit {limit}, the member with the smallest safe batch")
    else:
        out.add("family", f"{names}: the family's batch is unknown ({limit}: {limit_est['unavailable']})")
    for m in family:
        est = m["batch_estimate"]
        if "batch" in est:
            limits = " (limits the batch)" if m["member"] == limit else ""
            out.add(f"  {m['member']}", f"{est['batch']} for {_student(m)}{limits}")
        else:
            out.add(f"  {m['member']}", f"{_student(m)}: estimate unavailable: {est['unavailable']}")


_PROVIDER_LABELS = {"CUDAExecutionProvider": "CUDA provider", "TensorrtExecutionProvider": "TensorRT provider"}


def _stack_lines(out: _Lines, stacks: dict[str, Any]) -> None:
    """The NVIDIA driver, CuPy and onnxruntime: built for which CUDA, whether each starts (else what it
    misses), and the install command for this driver."""
    driver, cupy, ort, install = stacks["driver"], stacks["cupy"], stacks["onnxruntime"], stacks["install"]
    out.rows.append("gpu stacks")
    if driver["cuda_version"] is None:
        out.add("NVIDIA driver", "none (libcuda.so.1 not found)")
    else:
        gpus = "; ".join(f"{g['name']}, driver {g['driver']}, compute capability {g['compute_capability']}"
                         for g in driver["gpus"])
        out.add("NVIDIA driver", f"supports CUDA {driver['cuda_version']}" + (f" ({gpus})" if gpus else ""))
    if not cupy["packages"]:
        out.add("CuPy", "not installed (training runs on the CPU)")
    else:
        built = f" for CUDA {cupy['cuda_major']}" if cupy["cuda_major"] else ""
        wheels = ", ".join(f"{n} {v}" for n, v in cupy["packages"].items())
        out.add("CuPy", f"{wheels}{built}: " + ("starts" if cupy["starts"] else f"cannot start: {cupy['reason']}"))
        if cupy["missing"]:
            out.add("  missing", ", ".join(cupy["missing"]))
    if not ort["packages"]:
        out.add("onnxruntime", "not installed (no serving)")
    elif "error" in ort:
        out.add("onnxruntime", f"cannot be imported: {ort['error']}")
    else:
        built = f" for CUDA {ort['cuda']}" if ort["cuda"] else " (CPU only)"
        out.add("onnxruntime", f"{ort['package']} {ort['version']}{built}")
        for provider, result in ort["providers"].items():
            out.add(f"  {_PROVIDER_LABELS.get(provider, provider)}",
                    "starts" if result["starts"] else f"cannot start: {result['reason']}")
            if result["missing"]:
                out.add("    missing", ", ".join(result["missing"]))
    out.add("install", f"{install['command']} ({install['why']})")
    for warning in install["warnings"]:
        out.add("warning", warning)


def render(facts: dict[str, Any]) -> str:
    """Human-readable report of :func:`collect`'s facts."""
    sw, cpu, gpu, req = facts["software"], facts["cpu"], facts["gpu"], facts["request"]
    out = _Lines(["leaflens doctor", "software"])
    if sw.get("leaflens"):  # facts saved before it was recorded have none
        out.add("leaflens", sw["leaflens"])
    out.add("Python", f"{sw['python']} ({sw['platform']})")
    for key, label in (("numpy", "NumPy"), ("cupy", "CuPy"), ("onnxruntime", "onnxruntime"), ("onnx", "onnx")):
        out.add(label, sw[key] or "not installed")
    if sw.get("onnxruntime_providers"):
        out.add("onnxruntime providers", ", ".join(sw["onnxruntime_providers"]))
    if "lite0_weights" in sw:  # facts saved before they were recorded have none
        out.add("Lite0 weights", sw["lite0_weights"] or "not installed: no EfficientNet-Lite0 teacher, and distill "
                f"trains the 'm' student instead of 'lite8' ({install_command('teacher')})")
        out.add("gradio", sw.get("gradio") or f"not installed: no web app ({install_command('serve-cpu')})")
        out.add("pillow-heif", sw.get("pillow_heif") or "not installed: HEIC photos are not read")
    out.rows.append("cpu")
    out.add("model", cpu["model"] or "unknown")
    out.add("cores", f"{cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process"
                     + (f" (cgroup CPU quota {cpu['cpu_quota']:g})" if cpu.get("cpu_quota") else ""))
    if cpu.get("threads_override") is not None:
        out.add("threads", f"{cpu['threads']} ({THREADS_ENV} is set)")
    out.add("RAM", _gib(cpu["ram_bytes"]))
    blas = cpu["blas"]
    for key in ("blas", "lapack"):
        if key in blas:
            out.add(key.upper(), f"{blas[key]['name']} {blas[key]['version'] or ''}".strip())
    if blas.get("simd_found"):
        out.add("SIMD", ", ".join(blas["simd_found"]))
    for pool in blas.get("threadpools", []):
        out.add("threadpool", f"{pool['internal_api']} {pool['version']} ({pool['num_threads']} threads)")
    if "error" in blas:
        out.add("BLAS", blas["error"])
    if "gpu_stacks" in facts:
        _stack_lines(out, facts["gpu_stacks"])
    out.rows.append("gpu")
    if not gpu["available"]:
        out.rows.append(f"  no GPU: {gpu['reason']}")
        out.rows.append("  CPU-only machine: training and inference run on the CPU path "
                        "(on an NVIDIA machine, 'install' above names the extra for its driver)")
        est = facts.get("cpu_batch_estimate")
        if est is not None:
            out.rows.append("training batch on the CPU")
            _estimate_lines(out, est, req, "available RAM")
            _family_lines(out, facts)
            out.add("note", est["note"])
        return "\n".join(out.rows)
    out.add("name", f"{gpu['name']} (device {gpu['device']}, {gpu['multiprocessors']} SMs)")
    out.add("compute capability", gpu["compute_capability"])
    out.add("memory", f"{_gib(gpu['total_bytes'])} total, {_gib(gpu['free_bytes'])} free")
    out.add("CUDA driver/runtime", f"{gpu['driver_version']} / {gpu['runtime_version']}")
    if "h2d_pinned_gbps" in gpu:
        out.add("host->device (pinned)", f"{gpu['h2d_pinned_gbps']:.1f} GB/s")
    _estimate_lines(out, gpu["batch_estimate"], req, "free GPU memory")
    _family_lines(out, facts)
    return "\n".join(out.rows)


def _parse_widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.replace(" ", "").strip("[]()").split(",") if w)
    except ValueError:
        raise ValueError(f"--widths must be comma-separated integers, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise ValueError(f"--widths must be positive integers, got {text!r}")
    return widths


def run(args: argparse.Namespace) -> int:
    from leaflens.pipeline.config import load_config  # noqa: PLC0415
    from leaflens.pipeline.models.family import check_family, escalation_names, family_option  # noqa: PLC0415

    recipe = None
    if args.run is not None:
        if args.family is not None:
            print("doctor: --family cannot be used with --run: a run folder holds one student, the one it kept",
                  file=sys.stderr)
            return 2
        try:
            spec, size = spec_from_run(args.run)
        except Exception as exc:  # CheckpointError, a missing folder, a foreign file
            print(f"doctor: cannot read the run {args.run}: {exc}", file=sys.stderr)
            return 2
        size = size if args.input_size is None else args.input_size
    else:
        from leaflens.pipeline.distill import without_missing_weights  # noqa: PLC0415

        # the students distill would train here: without the Lite0 weights the default 'lite8' is the 'm' student
        # (a family named with --family is sized as asked: distill refuses a liteN member it cannot start)
        recipe = (load_config() if args.family is not None else without_missing_weights(load_config(),
                                                                                        sizing=True)).model
        spec, size = default_spec(), args.input_size if args.input_size is not None else recipe.input_size or 64
        if args.model != "student":
            print(f"doctor: unknown --model {args.model!r}: only 'student' can be sized", file=sys.stderr)
            return 2
        if args.family is not None:
            try:
                check_family(family_option(args.family))
            except ValueError as exc:
                print(f"doctor: --family {args.family}: {exc}", file=sys.stderr)
                return 2
            try:  # sized as asked, but said: distill refuses a liteN member without the weights
                without_missing_weights(replace(load_config(), model=replace(recipe, family=family_option(
                    args.family))), family_given=True)
            except ValueError as exc:
                print(f"note: distill --family {args.family} would be refused here: {exc}", file=sys.stderr)
    if args.input_size is not None and not 8 <= args.input_size <= 1024:  # a 0 was sized at 64 without a word
        print(f"doctor: --input-size must be from 8 to 1024, got {args.input_size}", file=sys.stderr)
        return 2
    if size < 8:  # a run's own size (preprocess stores up to 2048 px, input size 0 takes it)
        print(f"doctor: the input size must be >= 8, got {size}", file=sys.stderr)
        return 2
    if args.classes is not None and args.classes < 2:
        print(f"doctor: --classes must be >= 2 (a classifier tells classes apart), got {args.classes}",
              file=sys.stderr)
        return 2
    changes: dict[str, Any] = {}
    try:
        if args.widths:
            changes["widths"] = _parse_widths(args.widths)
    except ValueError as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        return 2
    if args.classes:
        changes["num_classes"] = args.classes
    if args.mixed_precision:
        changes["mixed_precision"] = args.mixed_precision
    if changes:
        spec = ModelSpec(**{**asdict(spec), **changes, "source": "options" if args.run is None else spec.source})
    if recipe is None:  # a run folder: its kept student
        family = [MemberSpec("student", spec, size)]
    else:  # the recipe's family, scaled from the (possibly --widths) [model] student
        # --widths describes the [model] CNN: alone, it sizes that student (the "m" member); the recipe's own
        # family is sized with its larger students (model.escalate), which train at the same batch when they do
        names = (family_option(args.family) if args.family is not None else ("m",) if args.widths
                 else recipe.family + escalation_names(recipe))
        family = family_specs(replace(recipe, widths=spec.widths, input_size=size, family=names), spec)
    facts = collect_family(family, measure_bandwidth=not args.no_bandwidth, measure_batch=not args.no_measure)
    print(json.dumps(facts, indent=2, default=str) if args.json else render(facts))
    failure = gpu_requirement_failure(facts) if args.require_gpu else None
    if failure:
        print(f"doctor: --require-gpu: {failure}", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="report Python, NumPy, CuPy, GPU and BLAS facts",
        description="Report versions, CPU facts (cores, BLAS) and, with a GPU, its memory, measured pinned "
        "host-to-device bandwidth and the largest safe training batch for a model and input size (measured "
        "from real training steps at two small batches). Without a GPU, the memory ceiling of a CPU batch.",
    )
    parser.add_argument("--model", default="student", help="model to size the batch for (default: student)")
    parser.add_argument("--input-size", "--size", dest="input_size", type=int, default=None,
                        help="square input side in pixels (default: the recipe's model.input_size, 64, which a "
                             "family member's @PX replaces; or the run's image size)")
    parser.add_argument("--widths", default=None,
                        help="student conv widths, e.g. 32,64,128,256 (default: the distill recipe's); without "
                             "--family it sizes that CNN, the family's m member")
    parser.add_argument("--family", metavar="NAMES", default=None,
                        help="size every student of this family, comma-separated, e.g. s,m,l or m,m@128 "
                             "(as leaflens distill --family; default: the recipe's model.family and model.escalate) "
                             "and report the one that limits the batch")
    parser.add_argument("--classes", type=int, default=None, help="number of classes (default: 10, or the run's)")
    parser.add_argument("--mixed-precision", choices=("auto", "on", "off"), default=None,
                        help="size for float16 training (auto: on with a GPU; default: the recipe's setting)")
    parser.add_argument("--run", type=path_arg, default=None,
                        help="a trained run folder (leaflens distill --out): size its student and image size")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the host-to-device bandwidth measurement")
    parser.add_argument("--no-measure", action="store_true", help="skip the training-step memory measurements")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit 1, naming the reason (a missing CUDA library among them), without a usable GPU")
    parser.set_defaults(func=run)
    return parser
