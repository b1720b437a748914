"""A tiny deterministic training run for the checkpoint resume test (run as a subprocess).

    python _resume_script.py OUT_DIR EPOCHS [--kill-after-epoch K] [--resume]

With --kill-after-epoch it SIGKILLs itself right after saving that epoch's checkpoint, like a
power cut. The final parameters are written to OUT_DIR/final.npz.
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np  # noqa: E402

from leaflens.engine import Tensor, nn, ops  # noqa: E402
from leaflens.engine.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from leaflens.engine.optim import SGD, WarmupCosine  # noqa: E402


def main() -> None:
    out, epochs = Path(sys.argv[1]), int(sys.argv[2])
    kill_after = int(sys.argv[sys.argv.index("--kill-after-epoch") + 1]) if "--kill-after-epoch" in sys.argv else -1
    model_rng = np.random.default_rng(42)  # initial weights, then the dropout masks
    data_rng = np.random.default_rng(7)
    x = data_rng.standard_normal((48, 6, 6, 3)).astype(np.float32)
    y = data_rng.integers(0, 3, 48)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, rng=model_rng), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.GlobalAvgPool2d(), nn.Dropout(0.3, rng=model_rng), nn.Linear(8, 3, rng=model_rng))
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    sched = WarmupCosine(opt, total_steps=epochs * 3, warmup_steps=2)
    shuffle = np.random.default_rng(1)
    start = 0
    ckpt = out / "checkpoint.npz"
    if "--resume" in sys.argv and ckpt.exists():
        c = load_checkpoint(ckpt, model, opt, sched, generators={"model": model_rng})
        start = c.epoch + 1
        shuffle.bit_generator.state = c.extra["shuffle_rng"]
    for epoch in range(start, epochs):
        model.train()
        order = shuffle.permutation(48)
        for b in range(3):
            idx = order[b * 16:(b + 1) * 16]
            opt.zero_grad()
            ops.cross_entropy(model(Tensor(x[idx])), y[idx]).backward()
            opt.step()
            sched.step()
        save_checkpoint(ckpt, model, opt, sched, epoch=epoch, step=(epoch + 1) * 3,
                        extra={"shuffle_rng": shuffle.bit_generator.state}, generators={"model": model_rng})
        if epoch == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    np.savez(out / "final.npz", **model.state_dict())


if __name__ == "__main__":
    main()
