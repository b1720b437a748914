"""leaflens' deep-learning engine: tensors with autograd, ops, layers, optimisers, checkpoints.

NumPy on the CPU; CuPy (with the hand-written kernels in ``kernels/``) on a GPU, through one
array-module switch (``engine.backend``).
"""

import os

# OpenBLAS's worker threads busy-wait for a long time after every call by default. Between matmuls
# the engine runs its own threads (engine.parallel), and spinning BLAS threads would starve them:
# measured here, a training step ran 27 % faster with a short timeout. It must be set before NumPy
# loads OpenBLAS, so it has no effect when NumPy was imported first (the `leaflens` CLI sets it
# early too); an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from engine import ops  # noqa: E402
from engine.allocator import tune_allocator  # noqa: E402
from engine.config import enable_grad, grad_enabled, no_grad  # noqa: E402
from engine.tensor import Function, GraphFreedError, NonFiniteLossError, Tensor, as_tensor  # noqa: E402

tune_allocator()

__all__ = ["Function", "GraphFreedError", "NonFiniteLossError", "Tensor", "as_tensor", "enable_grad",
           "grad_enabled", "no_grad", "ops"]
