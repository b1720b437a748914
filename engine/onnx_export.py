"""Export an engine model to ONNX: trace one forward pass, convert each op, fold BatchNorm, check.

How: while the model runs once on an example input, ``Function.__call__`` (every engine op goes
through it) and ``Module.__call__`` are wrapped to record each op with its input and output
tensors and the module it ran in. The recorded ops are then replayed through the converter
registry in leaflens.engine.onnx_convert. Tracing was chosen over walking the module tree because a forward
may also call functional ops (a residual ``x + y``, ``ops.l2_normalize``, a reshape) that no module
describes, and because the trace hands converters the values forward resolved (TF-style 'same'
padding becomes explicit, possibly asymmetric pads; axes are normalised). The price: the graph
is specialised to the traced spatial size (the batch stays symbolic), and Python control flow
is frozen as it ran, which is what an inference graph of these models wants anyway.

The result follows one contract: one input (default "input", float32, NCHW, batch dimension
"batch"), one output per element the forward returns (default one, "logits"; rank-4 outputs are
NCHW, others as the engine gives them), parameters as initialisers, BatchNorm folded into the preceding Conv/Gemm, opset
:data:`OPSET` with IR version :data:`IR_VERSION`, checked with ``onnx.checker`` (full check).

:func:`convert_float16` makes the FP16 variant (weights and compute in float16, float32 input and
output kept through Cast nodes) for GPU execution providers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from leaflens import __version__
from leaflens.engine.backend import to_device
from leaflens.engine.config import no_grad
from leaflens.engine.nn.module import Module
from leaflens.engine.onnx_convert import NOT_EXPORTABLE, find_converter, supported_ops
from leaflens.engine.onnx_graph import ExportError, GraphBuilder, UnsupportedOpError, channels_first, identity
from leaflens.engine.tensor import Function, Tensor, _coerce_inputs
from leaflens.files import write_bytes_atomic

__all__ = ["IR_VERSION", "OPSET", "ExportError", "UnsupportedOpError", "convert_float16", "export_onnx",
           "nodes_reaching", "save_onnx", "supported_ops", "trace"]

# Opset 17 and IR version 8 were released together (onnx 1.12, 2022): onnxruntime >= 1.12 loads
# them, which covers every Triton Inference Server container since 22.08 (24.x ship 1.16-1.20).
OPSET = 17
IR_VERSION = 8
PRODUCER = "leaflens-engine"
FP16_MAX = float(np.finfo(np.float16).max)

_TRACE_LOCK = threading.Lock()


@dataclass
class TracedCall:
    """One engine op as it ran: the Function (with what forward resolved), inputs, outputs, module."""

    fn: Function
    inputs: list[Tensor]
    outputs: list[Tensor]
    scope: str


@contextlib.contextmanager
def trace(model: Module) -> Iterator[list[TracedCall]]:
    """Record every engine op this thread runs inside the block (other threads are not recorded).

    The wrappers are installed on the classes for the duration of the block only; a lock keeps two
    traces from nesting their patches.
    """
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[TracedCall] = []
    scopes: list[str] = []
    owner = threading.get_ident()
    fn_call, mod_call = Function.__call__, Module.__call__

    def traced_fn_call(self: Function, *inputs: Any) -> Any:
        if threading.get_ident() != owner:
            return fn_call(self, *inputs)
        tensors = _coerce_inputs(inputs)  # so scalar operands are Tensors we can see
        out = fn_call(self, *tensors)
        outs = list(out) if isinstance(out, tuple) else [out]
        calls.append(TracedCall(self, tensors, outs, scopes[-1] if scopes else ""))
        return out

    def traced_mod_call(self: Module, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return mod_call(self, *args, **kwargs)
        scopes.append(names.get(id(self), scopes[-1] if scopes else ""))
        try:
            return mod_call(self, *args, **kwargs)
        finally:
            scopes.pop()

    with _TRACE_LOCK:  # the trace patches the two classes' __call__ (hence the ignores) and restores them
        Function.__call__ = traced_fn_call  # type: ignore[method-assign]
        Module.__call__ = traced_mod_call  # type: ignore[method-assign]
        try:
            yield calls
        finally:
            Function.__call__ = fn_call  # type: ignore[method-assign]
            Module.__call__ = mod_call  # type: ignore[method-assign]


def _model_device(model: Module) -> str:
    for p in model.parameters():
        return p.device
    return "cpu"


def _unsupported(call: TracedCall) -> UnsupportedOpError:
    name = type(call.fn).__name__
    where = f"module '{call.scope}'" if call.scope else "the model's top-level forward"
    shapes = ", ".join(str(t.shape) for t in call.inputs)
    why = NOT_EXPORTABLE.get(name, "no ONNX converter is registered for it")
    return UnsupportedOpError(f"cannot export engine op {name} (inputs {shapes}) in {where}: {why}. "
                              f"Exportable ops: {', '.join(supported_ops())}")


def nodes_reaching(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes (topologically ordered, as given) whose results reach any of ``outputs``: export drops the
    others (e.g. a training-only head), INT8 quantisation uses it to tell the branches of a graph apart."""
    needed = set(outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    return keep[::-1]


def export_onnx(model: Module, input_shape: Sequence[int], *, input_name: str = "input",
                output_name: str | Sequence[str] = "logits", metadata: Mapping[str, str] | None = None,
                graph_name: str = "leaflens", doc_string: str = "", opset: int = OPSET,
                ir_version: int = IR_VERSION, trace_batch: int = 2, check: bool = True) -> onnx.ModelProto:
    """The ONNX graph of ``model`` for inputs of ONNX shape ``[batch, *input_shape]``.

    ``input_shape`` is given in ONNX layout without the batch: (C, H, W) for images, which the
    engine sees as NHWC (N, H, W, C); a 1-D shape (F,) is a plain feature vector. The model runs
    once in eval mode on seeded random data (its train/eval flags are restored afterwards).
    A forward that returns a tuple of Tensors gives one graph output per element, named by the
    sequence ``output_name`` (e.g. ``("logits", "ood_score")``).
    Raises :class:`UnsupportedOpError` naming any op without a converter, :class:`ExportError`
    for ops the contract cannot express (e.g. ones mixing the batch axis).
    """
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or any(d < 1 for d in input_shape):
        raise ExportError(f"input_shape must be positive sizes without the batch, e.g. (3, 64, 64); "
                          f"got {input_shape}")
    output_names = [output_name] if isinstance(output_name, str) else [str(n) for n in output_name]
    if not output_names or len(set(output_names)) != len(output_names) or input_name in output_names:
        raise ExportError(f"input and outputs need distinct names, got input {input_name!r} and outputs "
                          f"{output_names}")
    rank = len(input_shape) + 1
    in_perm = channels_first(rank)
    onnx_shape = (trace_batch, *input_shape)
    engine_shape = tuple(onnx_shape[i] for i in np.argsort(in_perm))
    x = np.random.default_rng(0).standard_normal(engine_shape).astype(np.float32)
    x_t = Tensor(to_device(x, _model_device(model)))

    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with no_grad(), trace(model) as calls:
            y = model(x_t)
    finally:
        for m, mode in modes:
            object.__setattr__(m, "training", mode)
    ys = list(y) if isinstance(y, tuple) else [y]
    if not all(isinstance(t, Tensor) for t in ys):
        raise ExportError(f"{type(model).__name__}.forward returned {type(y).__name__}; export needs a model "
                          "returning a Tensor or a tuple of Tensors")
    if len(ys) != len(output_names):
        raise ExportError(f"{type(model).__name__}.forward returned {len(ys)} output(s) but {len(output_names)} "
                          f"output name(s) were given: {output_names}")

    uses: Counter[int] = Counter(id(t) for c in calls for t in c.inputs)
    for t in ys:
        uses[id(t)] += 1
    b = GraphBuilder(dict(uses), {id(p): n for n, p in model.named_parameters()})
    b.reserve(input_name)
    for name in output_names:
        b.reserve(name)
    b.bind(x_t, input_name, in_perm)
    for call in calls:
        if not any(b.is_activation(t) for t in call.inputs):
            continue  # depends on constants only: its traced result is used as a constant
        converter = find_converter(call.fn)
        if converter is None:
            raise _unsupported(call)
        b.scope = call.scope
        converter(b, call.fn, call.inputs, call.outputs)
    b.scope = ""
    outputs = []
    for t, name in zip(ys, output_names):
        if not b.is_activation(t):
            raise ExportError(f"output {name!r} of {type(model).__name__} does not depend on its input")
        out_perm = channels_first(4) if t.ndim == 4 else identity(t.ndim)
        final = b.operand(t, out_perm)
        if final == input_name or final in output_names:
            b.nodes.append(helper.make_node("Identity", [final], [name], name=f"/Identity_{name}"))
        else:
            b.rename(final, name)
        out_shape = [t.shape[i] for i in out_perm]
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
        outputs.append(helper.make_tensor_value_info(name, elem, ["batch", *out_shape[1:]]))
    b.nodes[:] = nodes_reaching(b.nodes, output_names)

    graph = helper.make_graph(
        b.nodes, graph_name,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", *input_shape])],
        outputs,
        b.used_initializers(),
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version,
                              producer_name=PRODUCER, producer_version=__version__)
    proto.doc_string = doc_string or f"{type(model).__name__} exported by the leaflens engine"
    if metadata:
        helper.set_model_props(proto, {str(k): str(v) for k, v in metadata.items()})
    if check:
        onnx.checker.check_model(proto, full_check=True)
    return proto


# ---- FP16 -----------------------------------------------------------------------------------------
def _to_fp16(arr: np.ndarray, name: str) -> np.ndarray:
    if not np.all(np.isfinite(arr)):
        raise ExportError(f"FP16 conversion: initialiser {name!r} holds non-finite values")
    big = float(np.abs(arr).max()) if arr.size else 0.0
    if big > FP16_MAX:
        raise ExportError(f"FP16 conversion: initialiser {name!r} reaches {big:.4g}, beyond float16's "
                          f"{FP16_MAX:.0f}; keep this model in FP32")
    out = arr.astype(np.float16)
    if arr.size == 1 and arr.reshape(-1)[0] != 0 and out.reshape(-1)[0] == 0:
        # a scalar such as an epsilon that float16 rounds to zero: keep it positive (smallest normal)
        out = np.full(arr.shape, np.sign(arr.reshape(-1)[0]) * np.finfo(np.float16).tiny, np.float16)
    return out


def _float32_only_nodes(g: onnx.GraphProto, keep: set[str]) -> set[int]:
    """Indices of the nodes that compute only the graph outputs in ``keep``: those outputs' ancestors that no
    other output depends on."""
    producer = {out: i for i, node in enumerate(g.node) for out in node.output}

    def ancestors(names: Sequence[str]) -> set[int]:
        seen: set[int] = set()
        stack = [producer[n] for n in names if n in producer]
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(producer[n] for n in g.node[i].input if n in producer)
        return seen

    return ancestors([o.name for o in g.output if o.name in keep]) - \
        ancestors([o.name for o in g.output if o.name not in keep])


def convert_float16(model: onnx.ModelProto, check: bool = True,
                    keep_float32: Sequence[str] = ()) -> onnx.ModelProto:
    """A copy of ``model`` computing in float16, with its float32 inputs/outputs kept.

    Float initialisers become float16, Cast nodes are inserted after each float32 graph input and
    before each float32 graph output, and Cast nodes inside the graph that produced float32 now
    produce float16. Refuses (naming the initialiser) weights outside float16's range.

    ``keep_float32`` names graph outputs computed in float32 from where they leave the other outputs'
    computation (its float16 tensors are cast up there): a score that sums squared distances overflows
    float16's 65,504 for the photos it exists to flag (the out-of-domain score).
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    keep = set(keep_float32)
    unknown = keep - {o.name for o in g.output}
    if unknown:
        raise ExportError(f"FP16 conversion: no graph output named {sorted(unknown)} to keep in float32")
    wide = _float32_only_nodes(g, keep) if keep else set()
    float_tensors: set[str] = set()
    if wide:  # which tensors a float32 node reads are floats (a shape or an index must not be cast)
        typed = onnx.shape_inference.infer_shapes(model)
        float_tensors = {v.name for v in (*typed.graph.value_info, *typed.graph.input, *typed.graph.output)
                         if v.type.tensor_type.elem_type == TensorProto.FLOAT}
        float_tensors |= {i.name for i in g.initializer if i.data_type == TensorProto.FLOAT}
    taken = {n for node in g.node for n in (*node.input, *node.output)} | {i.name for i in g.initializer}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    narrow_users = {n for i, node in enumerate(g.node) if i not in wide for n in node.input}
    wide_users = {n for i, node in enumerate(g.node) if i in wide for n in node.input}
    extra_inits: list[onnx.TensorProto] = []
    renamed_for_wide: dict[str, str] = {}
    for init in g.initializer:
        if init.data_type != TensorProto.FLOAT or init.name not in narrow_users:
            continue  # only float32 nodes read it (or it is no float): it stays as it is
        values = numpy_helper.to_array(init)
        if init.name in wide_users:  # read by both: the float32 nodes get a float32 copy
            copy = fresh(f"{init.name}_fp32")
            extra_inits.append(numpy_helper.from_array(values, copy))
            renamed_for_wide[init.name] = copy
        init.CopyFrom(numpy_helper.from_array(_to_fp16(values, init.name), init.name))
    g.initializer.extend(extra_inits)
    for i, node in enumerate(g.node):
        if i in wide:
            continue
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to" and attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16
        elif node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                    half_values = _to_fp16(numpy_helper.to_array(attr.t), node.name)
                    attr.t.CopyFrom(numpy_helper.from_array(half_values, attr.t.name))

    head: list[onnx.NodeProto] = []
    for inp in g.input:
        if inp.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        half = fresh(f"{inp.name}_fp16")
        for i, node in enumerate(g.node):
            if i in wide:
                continue  # float32 nodes read the float32 input itself
            for k, name in enumerate(node.input):
                if name == inp.name:
                    node.input[k] = half
        head.append(helper.make_node("Cast", [inp.name], [half], to=TensorProto.FLOAT16,
                                     name=fresh(f"/Cast_{inp.name}_to_fp16")))
    # float16 tensors a float32 node reads: cast up once, right after the node that makes them
    graph_inputs = {inp.name for inp in g.input}
    narrow_outputs = {n for i, node in enumerate(g.node) if i not in wide for n in node.output}
    up: dict[str, str] = {}
    for i in sorted(wide):
        node = g.node[i]
        for k, name in enumerate(node.input):
            if name in renamed_for_wide:
                node.input[k] = renamed_for_wide[name]
            elif name in narrow_outputs and name in float_tensors and name not in graph_inputs:
                if name not in up:
                    up[name] = fresh(f"{name}_fp32")
                node.input[k] = up[name]
    tail: list[onnx.NodeProto] = []
    for out in g.output:
        if out.type.tensor_type.elem_type != TensorProto.FLOAT or out.name in keep:
            continue
        half = fresh(f"{out.name}_fp16")
        for node in g.node:
            for seq in (node.input, node.output):
                for k, name in enumerate(seq):
                    if name == out.name:
                        seq[k] = half
        for src in list(up):  # an output another float32 node also reads is cast from its new name
            if src == out.name:
                up[half] = up.pop(src)
        tail.append(helper.make_node("Cast", [half], [out.name], to=TensorProto.FLOAT,
                                     name=fresh(f"/Cast_{out.name}_to_fp32")))
    nodes = list(head)
    for node in g.node:
        nodes.append(node)
        for name in node.output:
            if name in up:
                nodes.append(helper.make_node("Cast", [name], [up[name]], to=TensorProto.FLOAT,
                                              name=fresh(f"/Cast_{name}_to_fp32")))
    nodes += tail
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    kept = f", {', '.join(sorted(keep))} in float32" if keep else ""
    m.doc_string = (m.doc_string + f" (float16 weights and compute{kept}, float32 input/output)").strip()
    if check:
        onnx.checker.check_model(m, full_check=True)
    return m


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` atomically (temporary file beside it, fsync, rename)."""
    data = model.SerializeToString()
    return write_bytes_atomic(path, data, fsync=True)
