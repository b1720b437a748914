"""One ONNX converter per engine op (Function subclass), looked up by the exporter in a registry.

A converter receives the GraphBuilder, the Function instance as it ran in the traced forward pass
(its attributes hold what forward resolved: padding, kernel, axes, ...), the input tensors and
the output tensors. It appends nodes and binds each output to an ONNX value and layout (see
leaflens.engine.onnx_graph). Ops whose inputs are all constants never reach a converter: the exporter
stores their traced result as a constant instead.

To support a new op, write ``@register(TheFunction) def _convert(b, fn, inputs, outputs): ...``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import helper

from leaflens.engine.backend import to_device
from leaflens.engine.onnx_graph import ExportError, FoldTarget, GraphBuilder, channels_first, identity, inverse
from leaflens.engine.ops import activation, arith, conv, linalg, norm, pool, reduce, shape
from leaflens.engine.tensor import Function, Tensor

Converter = Callable[[GraphBuilder, Function, Sequence[Tensor], Sequence[Tensor]], None]
CONVERTERS: dict[type, Converter] = {}

# Why some engine ops have no converter on purpose (shown in the export error).
NOT_EXPORTABLE: dict[str, str] = {
    "Dropout": "dropout in training mode (export runs the model in eval mode; a forward that calls "
               "ops.dropout(..., training=True) itself cannot be exported)",
    "CrossEntropy": "a loss; export the model, not the training objective",
    "MSELoss": "a loss; export the model, not the training objective",
    "Var": "variance is only used by training-time statistics",
}


def register(*fn_types: type) -> Callable[[Converter], Converter]:
    def deco(f: Converter) -> Converter:
        for t in fn_types:
            CONVERTERS[t] = f
        return f

    return deco


def find_converter(fn: Function) -> Converter | None:
    for klass in type(fn).__mro__:
        if klass in CONVERTERS:
            return CONVERTERS[klass]
        if klass is Function:
            break
    return None


def supported_ops() -> list[str]:
    return sorted(t.__name__ for t in CONVERTERS)


def _np(x: Any) -> np.ndarray:
    return np.asarray(to_device(x, "cpu"))


# ---- elementwise ------------------------------------------------------------------------------
def _unary(op_type: str, **attrs: Any) -> Converter:
    def convert(b: GraphBuilder, fn: Function, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> None:
        v = b.value(inputs[0])
        (out,) = b.node(op_type, [v.name], **attrs)
        b.bind(outputs[0], out, v.perm)

    return convert


_fn: type[Function]
for _fn, _op in ((activation.ReLU, "Relu"), (activation.Sigmoid, "Sigmoid"), (activation.Tanh, "Tanh"),
                 (arith.Neg, "Neg"), (arith.Exp, "Exp"), (arith.Log, "Log"), (arith.Sqrt, "Sqrt"),
                 (arith.Abs, "Abs")):
    register(_fn)(_unary(_op))


@register(activation.LeakyReLU)
def _leaky_relu(b, fn, inputs, outputs):
    v = b.value(inputs[0])
    (out,) = b.node("LeakyRelu", [v.name], alpha=float(fn.slope))
    b.bind(outputs[0], out, v.perm)


def _clip(b: GraphBuilder, x: Tensor, out_t: Tensor, lo: float | None, hi: float | None) -> None:
    v = b.value(x)
    lo_name = "" if lo is None else b.scalar(lo, x.dtype, "clip_min")
    hi_name = "" if hi is None else b.scalar(hi, x.dtype, "clip_max")
    inputs = [v.name, lo_name, hi_name]
    while inputs[-1] == "":
        inputs.pop()
    (out,) = b.node("Clip", inputs)
    b.bind(out_t, out, v.perm)


@register(activation.ReLU6)
def _relu6(b, fn, inputs, outputs):
    _clip(b, inputs[0], outputs[0], 0.0, 6.0)


@register(arith.Clip)
def _clip_op(b, fn, inputs, outputs):
    _clip(b, inputs[0], outputs[0], fn.lo, fn.hi)


@register(arith.Pow)
def _pow_const(b, fn, inputs, outputs):
    v = b.value(inputs[0])
    (out,) = b.node("Pow", [v.name, b.scalar(fn.p, inputs[0].dtype, "exponent")])
    b.bind(outputs[0], out, v.perm)


@register(arith.Cast)
def _cast(b, fn, inputs, outputs):
    v = b.value(inputs[0])
    to = helper.np_dtype_to_tensor_dtype(np.dtype(fn.dtype))
    (out,) = b.node("Cast", [v.name], to=to)
    b.bind(outputs[0], out, v.perm)


def _binary(op_type: str) -> Converter:
    """Broadcasting binary op: activations share one layout, constants are stored pre-permuted."""

    def convert(b: GraphBuilder, fn: Function, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> None:
        acts = [t for t in inputs if b.is_activation(t)]
        ranks = {t.ndim for t in acts}
        if len(ranks) > 1:
            raise ExportError(f"{op_type} in {b.where()} broadcasts activations of shapes "
                              f"{[t.shape for t in acts]}; exported ops need activations of one rank "
                              "(NumPy would align the batch axis of one with a feature axis of the other)")
        rank = acts[0].ndim
        perm = b.value(acts[0]).perm
        names = [b.operand(t, perm) if b.is_activation(t) else b.broadcast_constant(t, rank, perm)
                 for t in inputs]
        (out,) = b.node(op_type, names)
        b.bind(outputs[0], out, perm)

    return convert


for _fn, _op in ((arith.Add, "Add"), (arith.Sub, "Sub"), (arith.Mul, "Mul"), (arith.Div, "Div"),
                 (arith.PowTensor, "Pow"), (arith.Maximum, "Max"), (arith.Minimum, "Min")):
    register(_fn)(_binary(_op))


# ---- convolution, pooling, normalisation ------------------------------------------------------
def _pads(p: Sequence[int]) -> list[int]:
    """Engine (top, bottom, left, right) -> ONNX [top, left, bottom, right]."""
    t, bo, l, r = (int(x) for x in p)
    return [t, l, bo, r]


def _need_constant(b: GraphBuilder, t: Tensor, what: str, op: str) -> str:
    if b.is_activation(t):
        raise ExportError(f"{op} in {b.where()}: its {what} is computed from the input; only parameters or "
                          "constants can be exported as the " + what)
    return b.constant(t)


def _need_rank(b: GraphBuilder, t: Tensor, rank: int, op: str) -> None:
    if t.ndim != rank:
        raise ExportError(f"{op} in {b.where()} expects a rank-{rank} input, got shape {t.shape}")


@register(conv.Conv2d)
def _conv2d(b, fn, inputs, outputs):
    x, w = inputs[0], inputs[1]
    _need_rank(b, x, 4, "conv2d")
    names = [b.operand(x, channels_first(4)), _need_constant(b, w, "weight", "conv2d")]
    if len(inputs) > 2:
        names.append(_need_constant(b, inputs[2], "bias", "conv2d"))
    (out,) = b.node("Conv", names, kernel_shape=list(fn.kernel), strides=list(fn.stride), pads=_pads(fn.pads),
                    group=int(fn.groups), dilations=[1, 1])
    b.foldable[out] = FoldTarget(b.nodes[-1], id(outputs[0]), "conv")
    b.bind(outputs[0], out, channels_first(4))


@register(pool.MaxPool2d)
def _max_pool(b, fn, inputs, outputs):
    _need_rank(b, inputs[0], 4, "max_pool2d")
    (out,) = b.node("MaxPool", [b.operand(inputs[0], channels_first(4))], kernel_shape=list(fn.kernel),
                    strides=list(fn.stride), pads=_pads(fn.pads))
    b.bind(outputs[0], out, channels_first(4))


@register(pool.AvgPool2d)
def _avg_pool(b, fn, inputs, outputs):
    _need_rank(b, inputs[0], 4, "avg_pool2d")
    # the engine leaves padded positions out of the mean, as count_include_pad=0 does
    (out,) = b.node("AveragePool", [b.operand(inputs[0], channels_first(4))], kernel_shape=list(fn.kernel),
                    strides=list(fn.stride), pads=_pads(fn.pads), count_include_pad=0)
    b.bind(outputs[0], out, channels_first(4))


@register(pool.GlobalAvgPool2d)
def _global_avg_pool(b, fn, inputs, outputs):
    _need_rank(b, inputs[0], 4, "global_avg_pool2d")
    (g,) = b.node("GlobalAveragePool", [b.operand(inputs[0], channels_first(4))])
    (out,) = b.node("Flatten", [g], axis=1)  # (N, C, 1, 1) -> (N, C)
    b.bind(outputs[0], out, identity(2))


def _bn_affine(fn: norm.BatchNorm, gamma: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eval-mode BatchNorm as y = x * scale + shift (float64 for an exact fold)."""
    mean = _np(fn.running_mean).astype(np.float64)
    var = _np(fn.running_var).astype(np.float64)
    scale = gamma.astype(np.float64) / np.sqrt(var + fn.eps)
    return scale, beta.astype(np.float64) - mean * scale


@register(norm.BatchNorm)
def _batch_norm(b, fn, inputs, outputs):
    x, gamma_t, beta_t = inputs
    if fn.training:
        raise ExportError(f"batch_norm in {b.where()} ran in training mode (batch statistics); "
                          "call model.eval() before exporting")
    if b.is_activation(gamma_t) or b.is_activation(beta_t):
        raise ExportError(f"batch_norm in {b.where()}: a weight/bias computed from the input cannot be "
                          "exported")
    v = b.value(x)
    gamma, beta = _np(gamma_t.data), _np(beta_t.data)
    target = b.foldable.get(v.name)
    # fold only when this BN is the sole reader of exactly the tensor the conv/gemm produced (not,
    # say, a transposed view of it, whose last axis would not be the layer's output channels)
    if target is not None and target.tensor_id == id(x) and b.uses.get(id(x), 0) == 1:
        _fold(b, target, fn, gamma, beta, x.dtype)
        b.bind(outputs[0], v.name, v.perm)
        return
    perm = channels_first(x.ndim)
    dt = x.dtype
    names = [b.operand(x, perm),
             b.initializer(gamma.astype(dt), b.param_names.get(id(gamma_t), "bn_weight")),
             b.initializer(beta.astype(dt), b.param_names.get(id(beta_t), "bn_bias")),
             b.initializer(_np(fn.running_mean).astype(dt), f"{b.scope or 'batch_norm'}.running_mean"),
             b.initializer(_np(fn.running_var).astype(dt), f"{b.scope or 'batch_norm'}.running_var")]
    (out,) = b.node("BatchNormalization", names, epsilon=float(fn.eps))
    b.bind(outputs[0], out, perm)


def _fold(b: GraphBuilder, target: FoldTarget, fn: norm.BatchNorm, gamma: np.ndarray, beta: np.ndarray,
          dtype: Any) -> None:
    """Fold y = bn(layer(x)) into the layer: W' = W * scale per output channel, b' = b * scale + shift."""
    node = target.node
    scale, shift = _bn_affine(fn, gamma, beta)
    w = b.initializers[node.input[1]].astype(np.float64)
    bias = b.initializers[node.input[2]].astype(np.float64) if len(node.input) > 2 else np.zeros(w.shape[0])
    if w.shape[0] != scale.shape[0]:
        raise ExportError(f"batch_norm in {b.where()} has {scale.shape[0]} channels but the layer before "
                          f"it has {w.shape[0]} outputs")
    w_folded = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    b_folded = bias * scale + shift
    base = node.input[1].removesuffix(".weight")  # the layer's parameter name, e.g. "features.0.0"
    node.input[1] = b.initializer(w_folded.astype(dtype), f"{base}.weight_bn_folded")
    bias_name = b.initializer(b_folded.astype(dtype), f"{base}.bias_bn_folded")
    if len(node.input) > 2:
        node.input[2] = bias_name
    else:
        node.input.append(bias_name)
    b.foldable.pop(node.output[0], None)


@register(norm.L2Normalize)
def _l2_normalize(b, fn, inputs, outputs):
    # ReduceL2 + Max(eps) + Div reproduces x / max(||x||, eps) exactly; LpNormalization has no eps
    # and gives NaN for an all-zero vector.
    x = inputs[0]
    v = b.value(x)
    b.check_batch_axis("l2_normalize", [fn.axis], x.ndim)
    (n,) = b.node("ReduceL2", [v.name], axes=[v.onnx_axis(fn.axis)], keepdims=1)
    (d,) = b.node("Max", [n, b.scalar(fn.eps, x.dtype, "eps")])
    (out,) = b.node("Div", [v.name, d])
    b.bind(outputs[0], out, v.perm)


@register(activation.Softmax, activation.LogSoftmax)
def _softmax(b, fn, inputs, outputs):
    x = inputs[0]
    v = b.value(x)
    b.check_batch_axis("softmax", [fn.axis], x.ndim)
    op = "Softmax" if isinstance(fn, activation.Softmax) else "LogSoftmax"
    (out,) = b.node(op, [v.name], axis=v.onnx_axis(fn.axis))
    b.bind(outputs[0], out, v.perm)


# ---- matrix products ----------------------------------------------------------------------------
@register(linalg.Linear)
def _linear(b, fn, inputs, outputs):
    x, w = inputs[0], inputs[1]
    _need_rank(b, x, 2, "linear")
    names = [b.canonical(x), _need_constant(b, w, "weight", "linear")]
    if len(inputs) > 2:
        names.append(_need_constant(b, inputs[2], "bias", "linear"))
    (out,) = b.node("Gemm", names, transB=1)
    b.foldable[out] = FoldTarget(b.nodes[-1], id(outputs[0]), "gemm")
    b.bind(outputs[0], out, identity(2))


@register(linalg.MatMul)
def _matmul(b, fn, inputs, outputs):
    a, c = inputs
    if not b.is_activation(a):
        raise ExportError(f"matmul in {b.where()}: a constant left operand would multiply across the "
                          "batch axis")
    if b.is_activation(c) and c.ndim != a.ndim:
        raise ExportError(f"matmul in {b.where()} of activations with shapes {a.shape} and {c.shape}")
    (out,) = b.node("MatMul", [b.canonical(a), b.canonical(c)])
    b.bind(outputs[0], out, identity(outputs[0].ndim))


# ---- shapes ----------------------------------------------------------------------------------------
@register(shape.Reshape)
def _reshape(b, fn, inputs, outputs):
    x, y = inputs[0], outputs[0]
    if x.ndim == 0 or y.ndim == 0 or y.shape[0] != x.shape[0]:
        raise ExportError(f"reshape in {b.where()} from {x.shape} to {y.shape} changes the batch axis; the "
                          "exported graph keeps the batch first and symbolic")
    # the element order of a reshape depends on the layout: reshape in the engine's (NHWC) order
    target = b.initializer(np.asarray([0, *y.shape[1:]], dtype=np.int64), f"{b._prefix()}shape")
    (out,) = b.node("Reshape", [b.canonical(x), target])  # 0 = copy the (symbolic) batch size
    b.bind(y, out, identity(y.ndim))


@register(shape.Transpose)
def _transpose(b, fn, inputs, outputs):
    # No node: the output is the same ONNX value under another layout. With onnx = in.transpose(p)
    # and out = in.transpose(axes), onnx = out.transpose([inv(axes)[i] for i in p]).
    x = inputs[0]
    axes = tuple(range(x.ndim))[::-1] if fn.axes is None else tuple(a % x.ndim for a in fn.axes)
    if x.ndim and axes[0] != 0:
        raise ExportError(f"transpose{axes} in {b.where()} moves the batch axis; the exported graph keeps "
                          "it first")
    v = b.value(x)
    inv = inverse(axes)
    b.bind(outputs[0], v.name, tuple(inv[i] for i in v.perm))


@register(shape.Concatenate)
def _concat(b, fn, inputs, outputs):
    acts = [t for t in inputs if b.is_activation(t)]
    rank = acts[0].ndim
    b.check_batch_axis("concatenate", [fn.axis], rank)
    perm = b.value(acts[0]).perm
    names = [b.operand(t, perm) for t in inputs]
    (out,) = b.node("Concat", names, axis=perm.index(fn.axis % rank))
    b.bind(outputs[0], out, perm)


# ---- reductions ------------------------------------------------------------------------------------
@register(reduce.Sum, reduce.Mean, reduce.Max, reduce.Min)
def _reduce(b, fn, inputs, outputs):
    x = inputs[0]
    v = b.value(x)
    op = {reduce.Sum: "ReduceSum", reduce.Mean: "ReduceMean", reduce.Max: "ReduceMax",
          reduce.Min: "ReduceMin"}[type(fn)]
    b.check_batch_axis(op, fn.axes, x.ndim)
    onnx_axes = sorted(v.onnx_axis(a) for a in fn.axes)
    keep = 1 if fn.keepdims else 0
    if op == "ReduceSum":  # opset 13+: axes is an input
        axes_name = b.initializer(np.asarray(onnx_axes, dtype=np.int64), f"{b._prefix()}axes")
        (out,) = b.node(op, [v.name, axes_name], keepdims=keep)
    else:  # opset < 18: axes is an attribute
        (out,) = b.node(op, [v.name], axes=onnx_axes, keepdims=keep)
    if fn.keepdims:
        perm = v.perm
    else:
        kept = [a for a in range(x.ndim) if a not in fn.axes]
        rank_of = {a: i for i, a in enumerate(kept)}
        perm = tuple(rank_of[a] for a in v.perm if a in rank_of)
    b.bind(outputs[0], out, perm)
