"""leaflens' deep-learning engine: tensors with autograd, ops, layers, optimisers, checkpoints.

NumPy on the CPU; CuPy (with the hand-written kernels in ``kernels/``) on a GPU, through one
array-module switch (``engine.backend``).
"""

from engine import ops
from engine.allocator import tune_allocator
from engine.config import enable_grad, grad_enabled, no_grad
from engine.tensor import Function, GraphFreedError, NonFiniteLossError, Tensor, as_tensor

tune_allocator()

__all__ = ["Function", "GraphFreedError", "NonFiniteLossError", "Tensor", "as_tensor", "enable_grad",
           "grad_enabled", "no_grad", "ops"]
