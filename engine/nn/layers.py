"""Layers: thin Modules over the functional ops in leaflens.engine.ops. Activations are NHWC."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from leaflens.engine import ops
from leaflens.engine.nn import init
from leaflens.engine.nn.module import Module, Parameter
from leaflens.engine.ops import fused
from leaflens.engine.ops.conv import Padding
from leaflens.engine.tensor import Tensor


class Linear(Module):
    """y = x W^T + b, W of shape (out_features, in_features); initial values drawn from ``rng``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rng: np.random.Generator | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(init.kaiming_uniform((out_features, in_features), "linear", rng=rng))
        self.bias = Parameter(init.uniform_bias(in_features, out_features, rng=rng)) if bias else None

    def forward(self, x: Any) -> Any:
        return ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Conv2d(Module):
    """2-D convolution of NHWC input with an OIHW weight (Kaiming-normal init for ReLU nets, from ``rng``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: Padding = 0, groups: int = 1, bias: bool = True, *,
                 rng: np.random.Generator | None = None):
        super().__init__()
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: in_channels={in_channels} and out_channels={out_channels} must both be "
                             f"divisible by groups={groups}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.groups = (kh, kw), stride, padding, groups
        shape = (out_channels, in_channels // groups, kh, kw)
        self.weight = Parameter(init.kaiming_normal(shape, "relu", mode="fan_out", rng=rng))
        self.bias = Parameter(np.zeros(out_channels, dtype=np.float32)) if bias else None

    def forward(self, x: Any) -> Any:
        return ops.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, groups={self.groups}, bias={self.bias is not None}")


class BatchNorm2d(Module):
    """Batch normalisation over the channel (last) axis; also serves (N, C) inputs.

    ``frozen``: use (and keep) the running statistics even in training mode, the affine weights still
    learning: how a pretrained network is fine-tuned on small batches of a small dataset.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(np.ones(num_features, dtype=np.float32))
        self.bias = Parameter(np.zeros(num_features, dtype=np.float32))
        self.register_buffer("running_mean", np.zeros(num_features, dtype=np.float32))
        self.register_buffer("running_var", np.ones(num_features, dtype=np.float32))
        self.frozen = False

    def forward(self, x: Any) -> Any:
        return ops.batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var,
                              training=self.training and not self.frozen, momentum=self.momentum, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


BatchNorm1d = BatchNorm2d


def freeze_batchnorm(model: Module, frozen: bool = True) -> int:
    """Make every BatchNorm of ``model`` (itself included) use and keep its running statistics in training mode
    too (:attr:`BatchNorm2d.frozen`), or learn them again with ``frozen=False``; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, BatchNorm2d)]
    for layer in layers:
        layer.frozen = frozen
    return len(layers)


class Dropout(Module):
    """Zero each value with probability ``p`` in training (scaling the rest by 1 / (1 - p)); the masks are
    drawn from ``rng`` (see :func:`set_dropout_generator` to point a built model's dropout elsewhere)."""

    def __init__(self, p: float = 0.5, *, rng: np.random.Generator | int | None = None):
        super().__init__()
        self.p = p
        # a seed becomes one generator here: seeded again at every call, each batch would get the same mask
        self.rng = rng if rng is None or isinstance(rng, np.random.Generator) else np.random.default_rng(rng)

    def forward(self, x: Any) -> Any:
        return ops.dropout(x, self.p, self.training, rng=self.rng)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ReLU(Module):
    def forward(self, x: Any) -> Any:
        return ops.relu(x)


class ReLU6(Module):
    def forward(self, x: Any) -> Any:
        return ops.relu6(x)


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        if not 0 <= negative_slope < 1:
            raise ValueError(f"LeakyReLU: negative_slope must be in [0, 1), got {negative_slope}")
        self.negative_slope = negative_slope

    def forward(self, x: Any) -> Any:
        return ops.leaky_relu(x, self.negative_slope)


class Sigmoid(Module):
    def forward(self, x: Any) -> Any:
        return ops.sigmoid(x)


class Tanh(Module):
    def forward(self, x: Any) -> Any:
        return ops.tanh(x)


class Softmax(Module):
    def __init__(self, axis: int = -1):
        super().__init__()
        self.axis = axis

    def forward(self, x: Any) -> Any:
        return ops.softmax(x, self.axis)


class MaxPool2d(Module):
    def __init__(self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                 padding: Padding = 0):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x: Any) -> Any:
        return ops.max_pool2d(x, self.kernel_size, self.stride, self.padding)


class AvgPool2d(MaxPool2d):
    def forward(self, x: Any) -> Any:
        return ops.avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class GlobalAvgPool2d(Module):
    """NHWC -> (N, C)."""

    def forward(self, x: Any) -> Any:
        return ops.global_avg_pool2d(x)


class Flatten(Module):
    def __init__(self, start_dim: int = 1):
        super().__init__()
        self.start_dim = start_dim

    def forward(self, x: Any) -> Any:
        return ops.flatten(x, self.start_dim)


class Identity(Module):
    def forward(self, x: Any) -> Any:
        return x


class Sequential(Module):
    """Apply modules in order; they are named "0", "1", ... in the state dict."""

    def __init__(self, *layers: Module | Iterable[Module]):
        super().__init__()
        if len(layers) == 1 and not isinstance(layers[0], Module):
            layers = tuple(layers[0])
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int | slice) -> Module:
        """The ``i``-th module; a slice is a Sequential of those modules (``model[:-1](x)``: all but the last),
        sharing their parameters and keeping their names, so that state dicts match the whole model's."""
        if not isinstance(i, slice):
            return list(self._modules.values())[i]
        part = Sequential()
        for name, layer in list(self._modules.items())[i]:
            setattr(part, name, layer)
        return part

    def forward(self, x: Any) -> Any:
        layers = list(self._modules.values())
        i = 0
        while i < len(layers):
            if _fuses_bn_relu_pool(layers, i, x):
                bn = layers[i]
                x = ops.batch_norm_relu_max_pool(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                   bn.momentum, bn.eps)
                i += 3
                continue
            x = layers[i](x)
            i += 1
        return x


def _fuses_bn_relu_pool(layers: list[Module], i: int, x: Any) -> bool:
    """Whether layers[i:i+3] are BatchNorm2d (batch statistics) -> ReLU -> MaxPool2d(2) that Sequential runs as
    one op (leaflens.engine.ops.fused: the same values, one pass over memory instead of several). Only with
    :data:`leaflens.engine.ops.fused.ENABLED`, on inputs that op serves, and when none of the three modules
    has a forward hook (a fused run calls none of them)."""
    if not fused.ENABLED or i + 2 >= len(layers):
        return False
    bn, act, pool = layers[i:i + 3]
    if type(bn) is not BatchNorm2d or type(act) is not ReLU or type(pool) is not MaxPool2d:
        return False
    return (bn.training and not bn.frozen and not any(m._forward_hooks for m in (bn, act, pool))
            and fused.pool_is_2x2(pool.kernel_size, pool.stride, pool.padding)
            and fused.applies(x.data if isinstance(x, Tensor) else x))


def set_dropout_generator(model: Module, rng: np.random.Generator) -> int:
    """Make every :class:`Dropout` in ``model`` draw its masks from ``rng``; returns how many there are.

    For a model whose layers were built (or loaded) with one generator and is trained with another, such
    as a pretrained network fine-tuned from a recipe's seed.
    """
    layers = [m for m in model.modules() if isinstance(m, Dropout)]
    for layer in layers:
        layer.rng = rng
    return len(layers)
