"""Differentiable operations, each a small forward/backward pair (see the modules beside this one)."""

from leaflens.engine.ops.activation import (
    dropout,
    leaky_relu,
    log_softmax,
    relu,
    relu6,
    sigmoid,
    softmax,
    tanh,
)
from leaflens.engine.ops.arith import (
    abs,
    add,
    cast,
    clip,
    div,
    exp,
    log,
    maximum,
    minimum,
    mul,
    neg,
    pow,
    sqrt,
    sub,
)
from leaflens.engine.ops.conv import conv2d
from leaflens.engine.ops.fused import batch_norm_relu_max_pool
from leaflens.engine.ops.linalg import linear, matmul
from leaflens.engine.ops.loss import cross_entropy, mse_loss
from leaflens.engine.ops.norm import batch_norm, l2_normalize
from leaflens.engine.ops.pool import avg_pool2d, global_avg_pool2d, max_pool2d
from leaflens.engine.ops.reduce import max, mean, min, sum, var
from leaflens.engine.ops.shape import concatenate, flatten, getitem, reshape, stack, transpose

__all__ = [
    "abs", "add", "avg_pool2d", "batch_norm", "batch_norm_relu_max_pool", "cast", "clip", "concatenate", "conv2d",
    "cross_entropy", "div", "dropout", "exp", "flatten", "getitem", "global_avg_pool2d", "l2_normalize",
    "leaky_relu", "linear", "log", "log_softmax", "matmul", "max", "max_pool2d", "maximum", "mean", "min",
    "minimum", "mse_loss", "mul", "neg", "pow", "relu", "relu6", "reshape", "sigmoid", "softmax", "sqrt", "stack",
    "sub", "sum", "tanh", "transpose", "var",
]
