"""leaflens' deep-learning engine: tensors with autograd, ops, layers, optimisers, checkpoints.

NumPy on the CPU; CuPy (with the hand-written kernels in ``leaflens.kernels``) on a GPU, through
one array-module switch (``leaflens.engine.backend``). Importing it changes no process-wide state:
the ``leaflens`` command makes its runtime settings (BLAS threads, allocator) explicitly, see
:mod:`leaflens.pipeline.cli.runtime`.
"""

from leaflens.engine import ops
from leaflens.engine.config import enable_grad, grad_enabled, no_grad
from leaflens.engine.tensor import Function, GraphFreedError, NonFiniteLossError, Tensor, as_tensor

__all__ = ["Function", "GraphFreedError", "NonFiniteLossError", "Tensor", "as_tensor", "enable_grad",
           "grad_enabled", "no_grad", "ops"]
