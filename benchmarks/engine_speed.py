"""CPU speed of the engine beside PyTorch: training steps and inference, interleaved in one process.

Cases (``--cases``, comma list; default all):
  student      the student CNN's training step (batch 64 of 64x64x3; forward, cross-entropy, backward,
               SGD with momentum), as the distillation stage runs it
  effnet160    EfficientNet-Lite0's training step at 160x160, batch 16: every block trained, BatchNorm
  effnet224    statistics frozen (running statistics, affine parameters trained), dropout 0.2, AdamW;
               what the teacher fine-tune runs (pipeline/teachers/effnet.py). The ImageNet weights when
               the package that ships them is installed, else a random initialisation of the same network
  infer1       the student's inference forward (eval mode, no graph) at batch 1 and at batch 64
  infer64

PyTorch (if importable) runs the same networks with the same weights and thread count, in NCHW and in
channels_last, in the same process. Each round times every implementation in turn (after one warm-up
step each, before the first round), so machine noise hits all alike; rates are medians over rounds and
ratios (engine / PyTorch) medians of per-round ratios. Peak memory is measured in a fresh subprocess per
(case, implementation) that imports only what it runs: ``peak_rss_mb_*`` is the process's peak resident
size (VmHWM, imports included), ``step_mb_*`` the growth of the peak over the resident size just before
the steps (the peak is reset through /proc/self/clear_refs), i.e. what the steps themselves need beyond
the libraries, the model and the input batch.

    python benchmarks/engine_speed.py [--cases student,effnet224] [--quick] [--rounds 5] [--threads 2]
    python benchmarks/engine_speed.py --profile --cases student,effnet224   # where the engine's time goes
    python benchmarks/engine_speed.py --cases student --ab fused,dynamic    # what each CPU path gains

The last line is JSON: ``student_ratio_nchw``, ``student_ratio_cl``, ``effnet_ratio_160``,
``effnet_ratio_224`` (against PyTorch NCHW; ``*_cl`` against channels_last), ``infer_ratio_b1``,
``infer_ratio_b64``, ``engine_img_s_<case>``, ``torch_img_s_<case>`` (NCHW), ``torch_cl_img_s_<case>``,
``peak_rss_mb_<case>_<impl>``, ``step_mb_<case>_<impl>`` (impl: engine, torch, torch_cl). With ``--profile``
or ``--ab`` it is one JSON object for all the cases: ``profile_<case>_*`` or ``ab_<case>_<switch>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# The runtime settings the `leaflens` command makes, before anything loads NumPy: OpenBLAS's thread
# spin timeout only takes effect before OpenBLAS is loaded (see leaflens.pipeline.cli.runtime).
from leaflens.pipeline.cli.runtime import configure_process

configure_process(engine=True)
# PyTorch's OpenMP threads spin at every barrier by default; on a shared machine one busy core then stalls
# each parallel region: measured here with other jobs running, its Lite0 step took 25 s with 2 threads
# against 3.5 s with 1. Passive waiting (read when PyTorch loads its OpenMP runtime) keeps the reference
# from collapsing under load, as the short OpenBLAS spin above does for the engine. --torch-spin: as is.
if "--torch-spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CASES = ("student", "effnet160", "effnet224", "infer1", "infer64")
IMPLS = ("engine", "torch", "torch_cl")
LABELS = {"engine": "engine (NumPy, NHWC)", "torch": "PyTorch NCHW", "torch_cl": "PyTorch channels_last"}
# Lite0's MBConv stages when the pretrained weights are not installed: (expand, kernel, stride, width, repeats)
LITE0_STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
                (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))


# --ab switches: (module, attribute, value with the path on, value with it off)
SWITCHES = {
    "fused": ("leaflens.engine.ops.fused", "ENABLED", True, False),  # BatchNorm -> ReLU -> max-pool in one op
    "dynamic": ("leaflens.engine.parallel", "DYNAMIC", True, False),  # tiles handed out as threads come free
    "winograd": ("leaflens.engine.ops.winograd", "MIN_CHANNELS", 16, 1 << 30),  # else im2col for every 3x3
    "monotone": ("leaflens.engine.ops.fused", "MONOTONE", True, False),  # fused op's k > 0 path
    "tnsplit": ("leaflens.engine.ops.linalg", "TN_SPLIT_MAX", 1 << 16, 0),  # weight gradients in pieces
}


@dataclass(frozen=True)
class Case:
    batch: int
    size: int
    steps: int  # timed steps per round (full mode)
    training: bool


def case_spec(name: str, args: argparse.Namespace) -> Case:
    if name == "student":
        return Case(args.batch, args.size, 10, True)
    if name.startswith("effnet"):
        return Case(16, int(name[len("effnet"):]), 2, True)
    if name.startswith("infer"):
        b = int(name[len("infer"):])
        return Case(b, args.size, 100 if b == 1 else 10, False)
    raise ValueError(f"--cases: unknown case {name!r}; choose from {', '.join(CASES)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list from {', '.join(CASES)}")
    p.add_argument("--batch", type=int, default=64, help="student training batch")
    p.add_argument("--size", type=int, default=64, help="student input size")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds; rates are medians over rounds, ratios medians of per-round ratios")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiply every case's timed steps per round")
    p.add_argument("--quick", action="store_true", help="3 rounds of a third of the steps, no memory subprocesses")
    p.add_argument("--threads", type=int, default=2, help="BLAS / PyTorch threads")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    p.add_argument("--torch-spin", action="store_true",
                   help="leave PyTorch's OpenMP threads spinning at barriers (default: OMP_WAIT_POLICY=PASSIVE)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--profile", action="store_true",
                   help="engine only: time of every op's forward and backward per step, instead of the comparison")
    p.add_argument("--ab", metavar="SWITCHES",
                   help=f"engine only: the step with every path on against the step with one of these turned off "
                        f"({', '.join(SWITCHES)}), interleaved; speed-ups are medians of per-round ratios")
    p.add_argument("--memory-probe", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 3)
        args.steps_scale /= 3
        args.no_memory = True
    args.case_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.ab_list = [a.strip() for a in (args.ab or "").split(",") if a.strip()]
    for a in args.ab_list:
        if a not in SWITCHES:
            p.error(f"--ab: unknown switch {a!r}; choose from {', '.join(SWITCHES)}")
    for c in args.case_list:
        try:
            case_spec(c, args)
        except ValueError as exc:  # "effnetX", "infer0"...: a usage error, not a traceback
            p.error(str(exc) if str(exc).startswith("--cases") else f"--cases: {c!r}: {exc}")
    for name in ("rounds", "threads", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be 1 or more, got {getattr(args, name)}")
    return args


# ---- the engine ---------------------------------------------------------------------------------------------
def engine_student(args: argparse.Namespace, case: Case) -> Callable[[], None]:
    import numpy as np

    from leaflens.engine import Tensor, no_grad, ops
    from leaflens.engine.optim import SGD
    from leaflens.pipeline.models.student import StudentCNN

    model = StudentCNN(args.classes, rng=np.random.default_rng(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, case.size, case.size, 3)).astype(np.float32)
    y = rng.integers(0, args.classes, case.batch)
    if not case.training:
        model.eval()

        def infer() -> None:
            with no_grad():
                model(Tensor(x))

        return infer
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        loss = ops.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()

    return step


def engine_effnet(args: argparse.Namespace, case: Case) -> tuple[Callable[[], None], object]:
    """The step and the engine network (whose weights the PyTorch copy takes)."""
    import numpy as np

    from leaflens.engine import Tensor, nn, ops
    from leaflens.engine.optim import AdamW
    from leaflens.pipeline.models.efficientnet import BlockSpec, EfficientNetLite, LiteConfig

    cfg = LiteConfig(padding="same", bn_eps=1e-3, normalization="tf")  # the teacher's (pipeline/teachers/effnet.py)
    try:
        from leaflens.pipeline.models.pretrained import find_lite0_weights, load_efficientnet_lite0

        net = load_efficientnet_lite0(find_lite0_weights(None), cfg)
    except Exception as exc:  # noqa: BLE001 - any reason the weights cannot be had: same network, random values
        print(f"EfficientNet-Lite0 weights unavailable ({exc}); random initialisation of the same network",
              file=sys.stderr)
        specs, cin = [], 32
        for expand, k, s, width, repeats in LITE0_STAGES:
            for r in range(repeats):
                specs.append(BlockSpec(cin, width, cin * expand, k, s if r == 0 else 1))
                cin = width
        net = EfficientNetLite(specs, config=cfg, rng=np.random.default_rng(0))
    net.reset_classifier(args.classes, np.random.default_rng(0))
    net.train()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()  # statistics frozen, affine parameters trained
    opt = AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, case.size, case.size, 3)).astype(np.float32)
    y = rng.integers(0, args.classes, case.batch)

    def step() -> None:
        opt.zero_grad()
        loss = ops.cross_entropy(net(Tensor(x)), y)
        loss.backward()
        opt.step()

    return step, net


# ---- PyTorch --------------------------------------------------------------------------------------------------
def torch_student(args: argparse.Namespace, case: Case, channels_last: bool) -> Callable[[], None]:
    import numpy as np
    import torch
    from torch import nn

    from leaflens.pipeline.models.student import StudentCNN

    def block(a, b):
        return [nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(128, args.classes))
    # the engine's initial weights (same layer order), so both train the same network from the same point
    own = StudentCNN(args.classes, rng=np.random.default_rng(0)).parameters()
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), own, strict=True):
            mine.copy_(torch.from_numpy(np.ascontiguousarray(theirs.data)))
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((case.batch, case.size, case.size, 3)).astype(np.float32))
    x = x.permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(rng.integers(0, args.classes, case.batch))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        x = x.contiguous(memory_format=torch.channels_last)
    if not case.training:
        model.eval()

        def infer() -> None:
            with torch.inference_mode():
                model(x)

        return infer
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()

    return step


def torch_lite0_module(net):
    """A torch.nn.Module copy of the engine's EfficientNetLite (same weights, TF 'same' padding per input)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    def param(a) -> nn.Parameter:
        return nn.Parameter(torch.from_numpy(np.array(a, dtype=np.float32)))

    def conv(c) -> nn.Conv2d:
        w = c.weight.data
        m = nn.Conv2d(w.shape[1] * c.groups, w.shape[0], w.shape[2:], stride=c.stride, groups=c.groups, bias=False)
        m.weight = param(w)
        return m

    def bn(b) -> nn.BatchNorm2d:
        m = nn.BatchNorm2d(b.num_features, eps=b.eps, momentum=b.momentum)
        m.weight, m.bias = param(b.weight.data), param(b.bias.data)
        assert m.running_mean is not None and m.running_var is not None  # track_running_stats is on
        m.running_mean.copy_(torch.from_numpy(np.asarray(b.running_mean)))
        m.running_var.copy_(torch.from_numpy(np.asarray(b.running_var)))
        return m

    def same(x, m: nn.Conv2d):
        k, s = m.kernel_size[0], m.stride[0]
        if k == 1:
            return x
        pads = []
        for size in x.shape[-2:]:
            total = max((-(-size // s) - 1) * s + k - size, 0)
            pads.append((total // 2, total - total // 2))
        return F.pad(x, [*pads[1], *pads[0]])

    class Block(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.spec = b.spec
            if b.spec.expand:
                self.expand, self.bn0 = conv(b.expand_conv), bn(b.bn0)
            self.dw, self.bn1 = conv(b.depthwise_conv), bn(b.bn1)
            self.project, self.bn2 = conv(b.project_conv), bn(b.bn2)

        def forward(self, x):
            h = F.relu6(self.bn0(self.expand(x))) if self.spec.expand else x
            h = F.relu6(self.bn1(self.dw(same(h, self.dw))))
            h = self.bn2(self.project(h))
            return h + x if self.spec.skip else h

    class Lite(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.stem_bn = conv(net.stem_conv), bn(net.stem_bn)
            self.blocks = nn.Sequential(*[Block(b) for b in net.blocks])
            self.head, self.head_bn = conv(net.head_conv), bn(net.head_bn)
            self.dropout = nn.Dropout(net.config.dropout)
            self.fc = nn.Linear(net.fc.in_features, net.fc.out_features)
            self.fc.weight, self.fc.bias = param(net.fc.weight.data), param(net.fc.bias.data)

        def forward(self, x):
            x = F.relu6(self.stem_bn(self.stem(same(x, self.stem))))
            x = F.relu6(self.head_bn(self.head(self.blocks(x))))
            return self.fc(self.dropout(x.mean(dim=(2, 3))))

    return Lite()


def torch_effnet(args: argparse.Namespace, case: Case, channels_last: bool, net) -> Callable[[], None]:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    model = torch_lite0_module(net).train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((case.batch, case.size, case.size, 3)).astype(np.float32))
    x = x.permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(rng.integers(0, args.classes, case.batch))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def build(args: argparse.Namespace, name: str, impls: tuple[str, ...]) -> dict[str, Callable[[], None]]:
    case = case_spec(name, args)
    out: dict[str, Callable[[], None]] = {}
    if name.startswith("effnet"):
        step, net = engine_effnet(args, case)
        if "engine" in impls:
            out["engine"] = step
        else:
            del step
        for impl in impls:
            if impl != "engine":
                out[impl] = torch_effnet(args, case, impl == "torch_cl", net)
        return out
    for impl in impls:
        out[impl] = engine_student(args, case) if impl == "engine" else torch_student(args, case, impl == "torch_cl")
    return out


# ---- timing and memory ----------------------------------------------------------------------------------------
def time_steps(step: Callable[[], None], n: int) -> float:
    """Steps per second over n steps."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return n / (time.perf_counter() - t0)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_probe(args: argparse.Namespace, name: str, impl: str) -> None:
    """In a fresh process: build one implementation of one case, run its steps, print its peak memory."""
    if impl != "engine":
        import torch

        torch.set_num_threads(args.threads)
    runner = build(args, name, (impl,))[impl]
    rss_before = _status_kb("VmRSS")
    hwm_import = _status_kb("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        reset = True
    except OSError:
        reset = False
    for _ in range(3):
        runner()
    hwm = _status_kb("VmHWM")
    print(json.dumps({"peak_rss_mb": round(max(hwm, hwm_import) / 1024, 1),
                      "step_mb": round((hwm - rss_before) / 1024, 1) if reset else None}))


def measure_memory(args: argparse.Namespace, name: str, impl: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-probe", name, impl, "--threads", str(args.threads),
           "--batch", str(args.batch), "--size", str(args.size), "--classes", str(args.classes)]
    if args.torch_spin:
        cmd.append("--torch-spin")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        print(f"memory probe {name}/{impl} failed:\n{res.stderr[-2000:]}", file=sys.stderr)
        return {"peak_rss_mb": None, "step_mb": None}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_case(args: argparse.Namespace, name: str, impls: tuple[str, ...], figures: dict) -> None:
    case = case_spec(name, args)
    runners = build(args, name, impls)
    steps = max(1, round(case.steps * args.steps_scale))
    for step in runners.values():
        step()  # warm-up: allocations and first-call overheads
    rates: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for impl, step in runners.items():
            rates[impl].append(time_steps(step, steps) * case.batch)
    del runners
    med = {k: statistics.median(v) for k, v in rates.items()}

    def ratio(ref: str) -> float | None:
        if ref not in rates:
            return None
        return statistics.median(e / r for e, r in zip(rates["engine"], rates[ref]))

    kind = "training step" if case.training else "inference forward"
    print(f"\n{name}: {kind}, batch {case.batch}, {case.size}x{case.size}x3, {args.threads} threads, "
          f"{args.rounds} interleaved rounds of {steps} steps")
    print(f"{'implementation':<28}{'images/s (median)':>18}{'min':>9}{'max':>9}{'engine / this':>15}")
    for impl, v in rates.items():
        r = 1.0 if impl == "engine" else ratio(impl)
        print(f"{LABELS[impl]:<28}{med[impl]:>18.1f}{min(v):>9.1f}{max(v):>9.1f}{r:>15.2f}")
    figures[f"engine_img_s_{name}"] = round(med["engine"], 2)
    figures[f"torch_img_s_{name}"] = round(med["torch"], 2) if "torch" in med else None
    figures[f"torch_cl_img_s_{name}"] = round(med["torch_cl"], 2) if "torch_cl" in med else None
    key = {"student": "student_ratio", "effnet160": "effnet_ratio_160", "effnet224": "effnet_ratio_224",
           "infer1": "infer_ratio_b1", "infer64": "infer_ratio_b64"}[name]
    rn, rc = ratio("torch"), ratio("torch_cl")
    if name == "student":
        figures["student_ratio_nchw"] = None if rn is None else round(rn, 3)
        figures["student_ratio_cl"] = None if rc is None else round(rc, 3)
    else:
        figures[key] = None if rn is None else round(rn, 3)
        figures[key + "_cl"] = None if rc is None else round(rc, 3)


def _all_functions(cls: type) -> list[type]:
    out: list[type] = []
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        out += [sub, *_all_functions(sub)]
    return out


def _op_label(fn: object) -> str:
    name = type(fn).__name__
    if name == "Conv2d":
        kh, kw = fn.kernel  # type: ignore[attr-defined]
        stride = "" if fn.stride == (1, 1) else f" s{fn.stride[0]}"  # type: ignore[attr-defined]
        return f"conv {fn.mode} {kh}x{kw}{stride}"  # type: ignore[attr-defined]
    if name == "BatchNorm":
        return "batch_norm (train stats)" if fn.training else "batch_norm (frozen stats)"  # type: ignore[attr-defined]
    return name


def profile_case(args: argparse.Namespace, name: str) -> dict[str, object]:
    """Wall time of every engine op's forward and backward over some steps (in the calling thread, which
    waits for the engine's worker threads, so the times include their share); the rest of the step is the
    optimizer, the graph bookkeeping and the Python around it. Prints a table; returns its figures for the
    JSON line (``profile_<case>_ms_per_step``, ``profile_<case>_img_s``, ``profile_<case>_ops``: ms per step
    by "op phase", and ``profile_<case>_rest_ms``)."""
    import leaflens.engine.ops  # noqa: F401 - every Function subclass defined
    from leaflens.engine.tensor import Function

    totals: dict[tuple[str, str], float] = {}

    def wrap(cls: type, phase: str) -> None:
        inner = cls.__dict__[phase]

        def timed(self, *a, **k):
            label = _op_label(self) if phase == "backward" else None
            t0 = time.perf_counter()
            out = inner(self, *a, **k)
            dt = time.perf_counter() - t0
            key = (label or _op_label(self), phase)
            totals[key] = totals.get(key, 0.0) + dt
            return out

        setattr(cls, phase, timed)

    for cls in _all_functions(Function):
        for phase in ("forward", "backward"):
            if phase in cls.__dict__:
                wrap(cls, phase)
    case = case_spec(name, args)
    step = build(args, name, ("engine",))["engine"]
    step()
    totals.clear()
    steps = max(1, round(case.steps * args.steps_scale))
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    total = time.perf_counter() - t0
    rest = total - sum(totals.values())
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    print(f"\n{name}: engine profile over {steps} steps, {total / steps * 1000:.0f} ms per step "
          f"({case.batch * steps / total:.1f} images/s)")
    print(f"{'op':<34}{'phase':<10}{'ms/step':>9}{'share':>8}")
    for (label, phase), t in rows:
        print(f"{label:<34}{phase:<10}{t / steps * 1000:>9.1f}{t / total:>8.1%}")
    print(f"{'optimizer, graph, Python':<34}{'':<10}{rest / steps * 1000:>9.1f}{rest / total:>8.1%}")
    return {f"profile_{name}_ms_per_step": round(total / steps * 1000, 2),
            f"profile_{name}_img_s": round(case.batch * steps / total, 2),
            f"profile_{name}_ops": {f"{label} {phase}": round(t / steps * 1000, 3) for (label, phase), t in rows},
            f"profile_{name}_rest_ms": round(rest / steps * 1000, 2)}


def _switch(name: str, on: bool) -> None:
    import importlib

    module, attr, on_value, off_value = SWITCHES[name]
    setattr(importlib.import_module(module), attr, on_value if on else off_value)


def ab_case(args: argparse.Namespace, name: str) -> dict[str, float]:
    """The engine's step with every --ab path on against the same step with one path off, in interleaved
    rounds (each variant its own model, built and warmed up with its switches set); per variant the median
    time per step, and the median over rounds of (time with the path off) / (time with all on). Prints a
    table; returns ``ab_<case>_<switch>`` (that ratio) for the JSON line."""
    case = case_spec(name, args)
    variants = {"all on": set(args.ab_list), **{f"{a} off": set(args.ab_list) - {a} for a in args.ab_list}}

    def set_switches(on: set[str]) -> None:
        for a in args.ab_list:
            _switch(a, a in on)

    steps: dict[str, Callable[[], None]] = {}
    for label, on in variants.items():
        set_switches(on)
        steps[label] = build(args, name, ("engine",))["engine"]
        steps[label]()
    n = max(1, round(case.steps * args.steps_scale))
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for label, on in variants.items():
            set_switches(on)
            times[label].append(1 / time_steps(steps[label], n))
    set_switches(set(args.ab_list))
    print(f"\n{name}: engine A/B, {args.rounds} interleaved rounds of {n} steps (load {os.getloadavg()[0]:.1f})")
    print(f"{'variant':<22}{'ms/step (median)':>18}{'min':>9}{'max':>9}{'off / all on':>14}")
    figures = {}
    for label, t in times.items():
        r = statistics.median(a / b for a, b in zip(t, times["all on"]))
        print(f"{label:<22}{statistics.median(t) * 1000:>18.0f}{min(t) * 1000:>9.0f}{max(t) * 1000:>9.0f}{r:>14.3f}")
        if label != "all on":
            figures[f"ab_{name}_{label.split()[0]}"] = round(r, 3)
    return figures


def main() -> None:
    args = parse_args()
    if args.memory_probe:
        memory_probe(args, *args.memory_probe)
        return
    if args.profile or args.ab_list:  # one JSON line after every case's table, holding all of their figures
        figures: dict[str, object] = {}
        for name in args.case_list:
            figures.update(profile_case(args, name) if args.profile else ab_case(args, name))
        figures.update({"threads": args.threads, "rounds": args.rounds, "load_average": os.getloadavg()[0]})
        print(json.dumps(figures))
        return
    impls: tuple[str, ...] = ("engine",)
    torch_version = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(args.threads)
            torch_version = torch.__version__
            impls = IMPLS
        except ImportError:
            print("PyTorch not installed: reference figures are null (pip install torch==2.13.0 to compare)")
    figures = {}
    for name in args.case_list:
        run_case(args, name, impls, figures)
    if not args.no_memory:
        print("\npeak memory (fresh process per case and implementation, 3 steps)")
        print(f"{'case':<12}{'implementation':<28}{'peak RSS MB':>12}{'step MB':>10}")
        for name in args.case_list:
            for impl in impls:
                m = measure_memory(args, name, impl)
                figures[f"peak_rss_mb_{name}_{impl}"] = m["peak_rss_mb"]
                figures[f"step_mb_{name}_{impl}"] = m["step_mb"]
                print(f"{name:<12}{LABELS[impl]:<28}{m['peak_rss_mb']!s:>12}{m['step_mb']!s:>10}")
    figures.update({"threads": args.threads, "rounds": args.rounds, "torch_version": torch_version,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_average": os.getloadavg()[0]})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
