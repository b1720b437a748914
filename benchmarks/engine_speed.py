"""Training-step speed of the student CNN: the engine on the CPU, beside PyTorch when it is installed.

One step = forward, cross-entropy, backward, SGD-with-momentum update; batch 64 of 64x64x3 images.
PyTorch (if importable) runs the same network with the same thread count, in NCHW and in
channels_last memory format, in the same process, interleaved round by round with the engine so
that machine noise hits both alike.

    python benchmarks/engine_speed.py [--batch 64] [--size 64] [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# The runtime settings the `leaflens` command makes, before anything loads NumPy: OpenBLAS's thread
# spin timeout only takes effect before OpenBLAS is loaded (see leaflens.pipeline.cli.runtime).
from leaflens.pipeline.cli.runtime import configure_process

configure_process(engine=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds; rates are medians over rounds, ratios medians of per-round ratios")
    p.add_argument("--threads", type=int, default=2, help="BLAS / PyTorch threads")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    return p.parse_args()


def engine_runner(args):
    import numpy as np

    from leaflens.engine import Tensor, ops
    from leaflens.engine.optim import SGD
    from leaflens.pipeline.models.student import StudentCNN

    model = StudentCNN(args.classes, rng=np.random.default_rng(0))
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.size, args.size, 3)).astype(np.float32)
    y = rng.integers(0, args.classes, args.batch)

    def step():
        opt.zero_grad()
        loss = ops.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()

    return step, model.num_parameters()


def torch_runner(args, channels_last: bool):
    import torch
    from torch import nn

    torch.manual_seed(0)

    def block(a, b):
        return [nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(128, args.classes))
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, args.classes, (args.batch,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()

    return step


def time_steps(step, n: int) -> float:
    step()  # warm-up (allocations, first-call overheads)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return n / (time.perf_counter() - t0)


def main() -> None:
    args = parse_args()
    runners = {}
    eng_step, params = engine_runner(args)
    runners["engine (NumPy, NHWC)"] = eng_step
    torch_version = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(args.threads)
            torch_version = torch.__version__
            runners["PyTorch NCHW"] = torch_runner(args, channels_last=False)
            runners["PyTorch channels_last"] = torch_runner(args, channels_last=True)
        except ImportError:
            pass
    rates: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, step in runners.items():
            rates[name].append(time_steps(step, args.steps) * args.batch)
    med = {k: statistics.median(v) for k, v in rates.items()}
    eng_name = "engine (NumPy, NHWC)"

    def ratio(ref: str) -> float | None:
        if ref not in rates:
            return None
        return statistics.median(e / r for e, r in zip(rates[eng_name], rates[ref]))

    eng = med[eng_name]
    tn, tc = med.get("PyTorch NCHW"), med.get("PyTorch channels_last")
    rn, rc = ratio("PyTorch NCHW"), ratio("PyTorch channels_last")
    print(f"student CNN training step: batch {args.batch}, {args.size}x{args.size}x3, {params:,} parameters, "
          f"{args.threads} threads, {args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'implementation':<28}{'images/s (median)':>18}{'min':>9}{'max':>9}{'engine / this':>15}")
    for name, v in rates.items():
        r = 1.0 if name == eng_name else ratio(name)
        print(f"{name:<28}{med[name]:>18.1f}{min(v):>9.1f}{max(v):>9.1f}{r:>15.2f}")
    if torch_version is None:
        print("PyTorch not installed: reference columns are null (pip install torch==2.13.0 to compare)")
    print(json.dumps({
        "engine_img_s": round(eng, 1),
        "torch_nchw_img_s": None if tn is None else round(tn, 1),
        "torch_cl_img_s": None if tc is None else round(tc, 1),
        "ratio_vs_torch_nchw": None if rn is None else round(rn, 3),
        "ratio_vs_torch_cl": None if rc is None else round(rc, 3),
        "batch": args.batch, "size": args.size, "threads": args.threads, "torch_version": torch_version,
    }))


if __name__ == "__main__":
    main()
