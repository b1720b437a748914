"""The ONNX graph under construction while an engine forward pass is replayed (see leaflens.engine.onnx_export).

The engine computes in NHWC; the exported graph is NCHW, as ONNX operators (Conv, pools,
BatchNormalization) expect. Rather than transposing around every op, each traced activation is
bound to an ONNX value together with a *layout*: a permutation ``perm`` such that

    onnx_value == engine_value.transpose(perm)

A 4-D activation coming out of a Conv has ``perm == (0, 3, 1, 2)`` (NCHW), a (N, C) activation
the identity. Converters ask :meth:`GraphBuilder.operand` for an input in the layout their ONNX op
needs; a Transpose node is inserted only when the layouts differ (e.g. before a Reshape of a 4-D
tensor, whose element order depends on the layout), and constants are simply stored pre-permuted.

Every activation keeps the batch on engine axis 0 and ONNX axis 0: that axis is symbolic in the
graph, so converters refuse ops that would move, merge or reduce it (:meth:`check_batch_axis`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import NodeProto, helper, numpy_helper

from leaflens.engine.backend import to_device
from leaflens.engine.tensor import Tensor


class ExportError(ValueError):
    """An engine model (or part of it) cannot be expressed as the ONNX graph asked for."""


class UnsupportedOpError(ExportError):
    """An engine op with no registered ONNX converter (the message names it and where it ran)."""


def identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


def channels_first(rank: int) -> tuple[int, ...]:
    """The layout with the engine's last (channel) axis moved to position 1: NHWC -> NCHW."""
    if rank < 3:
        return identity(rank)
    return (0, rank - 1, *range(1, rank - 1))


def inverse(perm: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(perm))


@dataclass(frozen=True)
class Value:
    """An activation: its ONNX name, its layout (onnx = engine.transpose(perm)) and engine shape."""

    name: str
    perm: tuple[int, ...]
    shape: tuple[int, ...]

    def onnx_axis(self, engine_axis: int) -> int:
        return self.perm.index(engine_axis % len(self.shape))


@dataclass
class FoldTarget:
    """A Conv or Gemm node whose per-output-channel affine follower (BatchNorm) can be folded into it."""

    node: NodeProto
    tensor_id: int  # id() of the engine tensor the node's output is bound to
    kind: str  # "conv" (weight OIHW) or "gemm" (weight (out, in), transB=1)


class GraphBuilder:
    """Nodes, initialisers and the map from traced engine tensors to ONNX values."""

    def __init__(self, uses: dict[int, int], param_names: dict[int, str]):
        self.nodes: list[NodeProto] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.values: dict[int, Value] = {}
        self.uses = uses  # id(tensor) -> how many op inputs (and graph outputs) read it
        self.param_names = param_names  # id(Parameter) -> dotted name in the model
        self.foldable: dict[str, FoldTarget] = {}  # ONNX value name -> the node that produced it
        self.scope = ""  # dotted module path of the op being converted (for node names, errors)
        self._names: set[str] = set()
        # (id(tensor), layout) for a plain constant, (id(tensor), ("bcast", rank, *layout)) for a broadcast one
        self._const_cache: dict[tuple[int, tuple[int | str, ...]], str] = {}
        self._transpose_cache: dict[tuple[str, tuple[int, ...]], str] = {}
        self._keep: list[Any] = []  # keeps tensors whose id() is a cache key alive

    # ---- names ------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A value/initialiser name not used before, derived from ``hint``."""
        base = hint or "v"
        name, k = base, 1
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def reserve(self, name: str) -> None:
        if name in self._names:
            raise ExportError(f"ONNX value name {name!r} is used twice")
        self._names.add(name)

    def _prefix(self) -> str:
        return f"/{self.scope.replace('.', '/')}/" if self.scope else "/"

    # ---- nodes and constants ---------------------------------------------------------------------
    def node(self, op_type: str, inputs: Sequence[str], n_out: int = 1, **attrs: Any) -> list[str]:
        """Append a node; returns the names of its (fresh) outputs."""
        base = f"{self._prefix()}{op_type}"
        outs = [self.fresh(f"{base}_output_{i}") for i in range(n_out)]
        name = self.fresh(base)
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs

    def initializer(self, array: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.initializers[name] = np.ascontiguousarray(array)
        return name

    def scalar(self, value: float, dtype: Any, hint: str) -> str:
        return self.initializer(np.asarray(value, dtype=dtype), f"{self._prefix()}{hint}")

    def is_activation(self, t: Tensor) -> bool:
        """True when ``t`` depends on the graph input (so it is a runtime value, not a constant)."""
        return id(t) in self.values

    def value(self, t: Tensor) -> Value:
        return self.values[id(t)]

    def constant(self, t: Tensor, perm: Sequence[int] | None = None, hint: str | None = None) -> str:
        """An initialiser holding ``t`` (a parameter or other constant), transposed by ``perm``."""
        if self.is_activation(t):
            raise ExportError(f"internal error: {self.where()} asked for an activation as a constant")
        perm = tuple(perm) if perm is not None else identity(t.ndim)
        key = (id(t), perm)
        if key not in self._const_cache:
            data = np.asarray(to_device(t.data, "cpu"))
            base = self.param_names.get(id(t)) or hint or f"{self._prefix()}const"
            if perm != identity(t.ndim):
                data = data.transpose(perm)
                base += "_T"
            self._const_cache[key] = self.initializer(data, base)
            self._keep.append(t)
        return self._const_cache[key]

    def broadcast_constant(self, t: Tensor, rank: int, perm: Sequence[int]) -> str:
        """A constant that broadcasts against an activation of ``rank`` stored in layout ``perm``.

        NumPy broadcasting aligns trailing axes, so the constant is first given leading 1s up to
        ``rank``, then permuted like the activation; leading 1s are dropped again afterwards.
        """
        data = np.asarray(to_device(t.data, "cpu"))
        if data.ndim > rank:
            raise ExportError(f"{self.where()}: a constant of shape {data.shape} broadcasts an activation of "
                              f"rank {rank} up to rank {data.ndim}, which would change the batch axis")
        if data.ndim == rank and rank > 0 and data.shape[0] != 1:
            raise ExportError(f"{self.where()}: a constant of shape {data.shape} has a batch axis of "
                              f"{data.shape[0]}; the exported graph has a symbolic batch size")
        key: tuple[int, tuple[int | str, ...]] = (id(t), ("bcast", rank, *perm))
        if key not in self._const_cache:
            full = data.reshape((1,) * (rank - data.ndim) + data.shape).transpose(perm)
            lead = 0
            while lead < full.ndim and full.shape[lead] == 1:
                lead += 1
            full = full.reshape(full.shape[lead:])
            base = self.param_names.get(id(t)) or f"{self._prefix()}const"
            self._const_cache[key] = self.initializer(full, base if full.shape == data.shape else base + "_T")
            self._keep.append(t)
        return self._const_cache[key]

    # ---- activations ----------------------------------------------------------------------------
    def bind(self, t: Tensor, name: str, perm: Sequence[int]) -> None:
        """Record that engine tensor ``t`` is ONNX value ``name`` in layout ``perm``."""
        perm = tuple(perm)
        if len(perm) != t.ndim:
            raise ExportError(f"internal error: layout {perm} for a tensor of shape {t.shape}")
        self.values[id(t)] = Value(name, perm, t.shape)
        self._keep.append(t)

    def operand(self, t: Tensor, perm: Sequence[int]) -> str:
        """``t`` as an ONNX value in layout ``perm`` (a Transpose node is added when needed)."""
        perm = tuple(perm)
        if not self.is_activation(t):
            return self.constant(t, perm)
        v = self.value(t)
        if v.perm == perm:
            return v.name
        key = (v.name, perm)
        if key not in self._transpose_cache:
            inv = inverse(v.perm)
            rel = [inv[i] for i in perm]  # onnx_new = onnx_old.transpose(rel)
            (out,) = self.node("Transpose", [v.name], perm=rel)
            self._transpose_cache[key] = out
        return self._transpose_cache[key]

    def canonical(self, t: Tensor) -> str:
        """``t`` in the engine's own layout (identity permutation)."""
        return self.operand(t, identity(t.ndim))

    # ---- checks and messages --------------------------------------------------------------------
    def where(self) -> str:
        return f"module '{self.scope}'" if self.scope else "the model's top-level forward"

    def check_batch_axis(self, op: str, axes: Sequence[int], rank: int) -> None:
        """Refuse an op acting along engine axis 0 (the symbolic batch axis)."""
        if any(int(a) % rank == 0 for a in axes):
            raise ExportError(f"{op} in {self.where()} acts along axis 0, the batch axis; the exported graph "
                              "keeps the batch symbolic, so batch-mixing ops cannot be exported")

    # ---- finishing -------------------------------------------------------------------------------
    def rename(self, old: str, new: str) -> None:
        """Rename an ONNX value everywhere it appears."""
        for node in self.nodes:
            for seq in (node.input, node.output):
                for i, name in enumerate(seq):
                    if name == old:
                        seq[i] = new
        for key, name in list(self._transpose_cache.items()):
            if name == old:
                self._transpose_cache[key] = new

    def used_initializers(self) -> list[Any]:
        """TensorProtos of the initialisers some node reads (folded-away originals are dropped)."""
        read = {name for node in self.nodes for name in node.input}
        return [numpy_helper.from_array(arr, name) for name, arr in self.initializers.items() if name in read]
