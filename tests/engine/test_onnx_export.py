"""ONNX export: every converter round-trips (engine vs onnxruntime), NHWC->NCHW, BatchNorm folding,
FP16, metadata, symbolic batch, and clear errors for what cannot be exported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from leaflens.engine import Tensor, nn, no_grad, ops  # noqa: E402
from leaflens.engine.onnx_export import (  # noqa: E402
    IR_VERSION,
    OPSET,
    ExportError,
    UnsupportedOpError,
    convert_float16,
    export_onnx,
)
from leaflens.pipeline.models.student import StudentCNN  # noqa: E402


class Fn(nn.Module):
    """A module whose forward is a function of its input and its own parameters."""

    def __init__(self, f: Callable[..., Any], **layers: nn.Module):
        super().__init__()
        self.f = f
        for k, v in layers.items():
            setattr(self, k, v)

    def forward(self, x):
        return self.f(self, x)


def _randomise_bn(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial running statistics and affine parameters, so folding is really tested."""
    rng = np.random.default_rng(seed)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            c = mod.num_features
            mod.running_mean = rng.normal(0, 0.5, c).astype(np.float32)
            mod.running_var = rng.uniform(0.3, 2.0, c).astype(np.float32)
            mod.weight.data = rng.normal(1, 0.3, c).astype(np.float32)
            mod.bias.data = rng.normal(0, 0.3, c).astype(np.float32)


def _session(proto) -> Any:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _engine(model: nn.Module, x: np.ndarray) -> np.ndarray:
    model.eval()
    with no_grad():
        return model(Tensor(x)).numpy()


def roundtrip(model: nn.Module, input_shape: tuple[int, ...], batch: int = 3, seed: int = 1,
              atol: float = 2e-5) -> tuple[Any, float]:
    """Export, run both, compare; returns (proto, max abs difference)."""
    proto = export_onnx(model, input_shape)
    rng = np.random.default_rng(seed)
    x_onnx = rng.normal(size=(batch, *input_shape)).astype(np.float32)
    x_engine = x_onnx.transpose(0, 2, 3, 1) if len(input_shape) == 3 else x_onnx
    want = _engine(model, np.ascontiguousarray(x_engine))
    if want.ndim == 4:  # 4-D outputs are NCHW in the graph
        want = want.transpose(0, 3, 1, 2)
    (got,) = _session(proto).run(None, {"input": x_onnx})
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    scale = max(1.0, float(np.abs(want).max()))
    assert diff <= atol * scale, f"max abs diff {diff} (output scale {scale})"
    return proto, diff


def _conv(cin=3, cout=4, k=3, **kw):
    return nn.Conv2d(cin, cout, k, **kw)


def _squeeze_excite(s, x):
    y = s.c(x)
    return y * ops.sigmoid(ops.mean(y, axis=(1, 2), keepdims=True))


IMAGE = (3, 9, 11)  # odd, non-square: catches H/W mix-ups and asymmetric 'same' padding
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "conv_bias_stride2": (lambda: _conv(stride=2, padding=1), IMAGE),
    "conv_asymmetric_pads": (lambda: _conv(padding=(1, 0, 2, 1)), IMAGE),
    "conv_same_stride2": (lambda: _conv(k=3, stride=2, padding="same"), IMAGE),
    "conv_same_k5_even_input": (lambda: _conv(k=5, stride=2, padding="same"), (3, 8, 10)),
    "conv_depthwise": (lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3, bias=False), IMAGE),
    "conv_grouped": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (4, 7, 7)),
    "conv_1x1_no_bias": (lambda: _conv(k=1, bias=False), IMAGE),
    "relu": (lambda: nn.Sequential(_conv(), nn.ReLU()), IMAGE),
    "relu6_as_clip": (lambda: Fn(lambda s, x: ops.relu6(s.c(x) * 4.0), c=_conv()), IMAGE),
    "leaky_relu": (lambda: nn.Sequential(_conv(), nn.LeakyReLU(0.2)), IMAGE),
    "sigmoid_tanh": (lambda: nn.Sequential(_conv(), nn.Sigmoid(), nn.Tanh()), IMAGE),
    "max_pool_padded": (lambda: nn.Sequential(_conv(), nn.MaxPool2d(3, 2, padding=1)), IMAGE),
    "max_pool_same": (lambda: nn.Sequential(_conv(), nn.MaxPool2d(3, 2, padding="same")), IMAGE),
    "avg_pool_padded": (lambda: nn.Sequential(_conv(), nn.AvgPool2d(3, 2, padding=1)), IMAGE),
    "global_avg_pool_linear": (lambda: nn.Sequential(_conv(), nn.GlobalAvgPool2d(), nn.Linear(4, 5)), IMAGE),
    "flatten_nhwc_then_linear": (lambda: nn.Sequential(_conv(stride=2), nn.Flatten(),
                                                       nn.Linear(4 * 4 * 5, 3)), IMAGE),
    "reshape": (lambda: Fn(lambda s, x: s.c(x).reshape(x.shape[0], -1, 2), c=_conv()), IMAGE),
    "transpose_then_flatten": (lambda: Fn(lambda s, x: ops.flatten(s.c(x).transpose(0, 3, 1, 2)), c=_conv()),
                               IMAGE),
    "transpose_then_conv": (lambda: Fn(lambda s, x: s.c2(s.c(x).transpose(0, 2, 1, 3)), c=_conv(),
                                       c2=_conv(4, 2)), IMAGE),
    "softmax_channels": (lambda: Fn(lambda s, x: ops.softmax(s.c(x), -1), c=_conv()), IMAGE),
    "softmax_axis1": (lambda: Fn(lambda s, x: ops.softmax(s.c(x), 1), c=_conv()), IMAGE),
    "log_softmax_logits": (lambda: Fn(lambda s, x: ops.log_softmax(s.l(ops.global_avg_pool2d(s.c(x)))),
                                      c=_conv(), l=nn.Linear(4, 6)), IMAGE),
    "l2_normalize": (lambda: Fn(lambda s, x: ops.l2_normalize(s.l(ops.global_avg_pool2d(s.c(x)))),
                                c=_conv(), l=nn.Linear(4, 6)), IMAGE),
    "l2_normalize_nhwc_channels": (lambda: Fn(lambda s, x: ops.l2_normalize(s.c(x), axis=-1), c=_conv()),
                                   IMAGE),
    "concat_channels": (lambda: Fn(lambda s, x: ops.concatenate([s.a(x), s.b(x)], axis=3),
                                   a=_conv(), b=_conv(cout=2)), IMAGE),
    "residual_add_sub": (lambda: Fn(lambda s, x: (s.a(x) + s.b(x)) - s.a(x) * 0.5,
                                    a=_conv(padding=1), b=_conv(padding=1)), IMAGE),
    "scale_by_channel_param": (lambda: Fn(lambda s, x: s.c(x) * s.g.weight + s.g.bias / 2.0,
                                          c=_conv(), g=nn.BatchNorm2d(4)), IMAGE),
    "divide_and_pow": (lambda: Fn(lambda s, x: (s.c(x) ** 2.0) / 3.0 + 1.0, c=_conv()), IMAGE),
    "squeeze_excite": (lambda: Fn(_squeeze_excite, c=_conv()), IMAGE),
    "reduce_sum_max_min": (lambda: Fn(lambda s, x: ops.sum(s.c(x), axis=(1, 2)) + ops.max(s.c(x), axis=(1, 2))
                                      - ops.min(s.c(x), axis=(1, 2)), c=_conv()), IMAGE),
    "mean_over_w_only": (lambda: Fn(lambda s, x: ops.mean(s.c(x), axis=2), c=_conv()), IMAGE),
    "clip_exp_log_sqrt_abs_neg": (lambda: Fn(lambda s, x: ops.sqrt(ops.exp(ops.clip(-ops.abs(s.c(x)), -3.0,
                                                                                    None)))
                                             + ops.log(ops.abs(s.c(x)) + 1.0), c=_conv()), IMAGE),
    "maximum_minimum": (lambda: Fn(lambda s, x: ops.maximum(s.a(x), s.b(x)) + ops.minimum(s.a(x), 0.1),
                                   a=_conv(), b=_conv()), IMAGE),
    "matmul_constant": (lambda: Fn(lambda s, x: ops.matmul(ops.global_avg_pool2d(s.c(x)), s.w.weight),
                                   c=_conv(), w=nn.Linear(5, 4)), IMAGE),
    "vector_input_mlp": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), (6,)),
    "batchnorm_after_relu_not_folded": (lambda: nn.Sequential(_conv(), nn.ReLU(), nn.BatchNorm2d(4)), IMAGE),
    "batchnorm1d_after_linear_folded": (lambda: nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)), (6,)),
    "student_cnn": (lambda: StudentCNN(4, widths=(4, 8)), (3, 16, 16)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_roundtrip_engine_vs_onnxruntime(case):
    factory, shape = CASES[case]
    model = factory()
    _randomise_bn(model)
    proto, _ = roundtrip(model, shape)
    assert proto.ir_version == IR_VERSION
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", OPSET)]


def _ops_of(proto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def test_exported_graph_uses_the_expected_onnx_ops():
    conv = export_onnx(nn.Conv2d(4, 4, 3, groups=4, padding=(0, 1, 1, 0)), (4, 6, 6))
    (node,) = conv.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["group"] == 4 and attrs["pads"] == [0, 1, 1, 0]  # [top, left, bottom, right]
    relu6 = export_onnx(Fn(lambda s, x: ops.relu6(s.c(x)), c=_conv()), IMAGE)
    assert _ops_of(relu6) == ["Conv", "Clip"]
    gap = export_onnx(nn.Sequential(_conv(), nn.GlobalAvgPool2d(), nn.Linear(4, 2)), IMAGE)
    assert _ops_of(gap) == ["Conv", "GlobalAveragePool", "Flatten", "Gemm"]
    flat = export_onnx(nn.Sequential(_conv(), nn.Flatten(), nn.Linear(4 * 7 * 9, 2)), IMAGE)
    assert _ops_of(flat) == ["Conv", "Transpose", "Reshape", "Gemm"]  # NCHW back to NHWC order first
    l2 = export_onnx(Fn(lambda s, x: ops.l2_normalize(ops.global_avg_pool2d(s.c(x))), c=_conv()), IMAGE)
    assert _ops_of(l2)[-3:] == ["ReduceL2", "Max", "Div"]


def test_batchnorm_is_folded_exactly():
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1, bias=True), nn.BatchNorm2d(5, eps=1e-3), nn.ReLU())
    _randomise_bn(model, seed=3)
    proto, diff = roundtrip(model, IMAGE, batch=4)
    assert "BatchNormalization" not in _ops_of(proto)
    assert diff < 1e-5
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    conv, bn = model[0], model[1]
    scale = bn.weight.data.astype(np.float64) / np.sqrt(bn.running_var.astype(np.float64) + 1e-3)
    want_w = conv.weight.data * scale[:, None, None, None]
    want_b = (conv.bias.data - bn.running_mean) * scale + bn.bias.data
    np.testing.assert_allclose(inits["0.weight_bn_folded"], want_w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(inits["0.bias_bn_folded"], want_b, rtol=1e-6, atol=1e-7)
    assert "0.weight" not in inits  # the unfolded original is not shipped


def test_batchnorm_not_folded_when_conv_output_is_also_read_elsewhere():
    model = Fn(lambda s, x: s.bn(s.c(x)) + s.c2(s.c(x)), c=_conv(padding=1), bn=nn.BatchNorm2d(4),
               c2=nn.Conv2d(4, 4, 1))
    _randomise_bn(model)
    # two calls of s.c give two tensors; make one tensor feed both instead:
    model.f = lambda s, x: (lambda y: s.bn(y) + s.c2(y))(s.c(x))
    proto, _ = roundtrip(model, IMAGE)
    assert "BatchNormalization" in _ops_of(proto)


def test_four_d_output_is_nchw_and_batch_is_symbolic():
    model = nn.Sequential(_conv(padding=1), nn.ReLU())
    proto = export_onnx(model, IMAGE)
    out = proto.graph.output[0].type.tensor_type.shape.dim
    assert out[0].dim_param == "batch" and [d.dim_value for d in out[1:]] == [4, 9, 11]
    sess = _session(proto)
    for batch in (1, 5):
        x = np.random.default_rng(batch).normal(size=(batch, *IMAGE)).astype(np.float32)
        (got,) = sess.run(None, {"input": x})
        want = _engine(model, np.ascontiguousarray(x.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_training_head_and_dropout_are_not_exported_and_modes_restored():
    model = StudentCNN(3, widths=(4, 8), teacher_dim=7, dropout=0.3).train()
    proto = export_onnx(model, (3, 16, 16))
    names = [i.name for i in proto.graph.initializer]
    assert not any(n.startswith("projection") for n in names)
    assert "Dropout" not in _ops_of(proto)
    assert all(m.training for m in model.modules())  # export ran in eval mode, then restored the flags


def test_metadata_round_trip_through_onnxruntime():
    meta = {"leaflens.classes": '["a", "b"]', "leaflens.input_size": "16", "note": "ünïcode ok"}
    proto = export_onnx(StudentCNN(2, widths=(4,)), (3, 16, 16), metadata=meta)
    got = _session(proto).get_modelmeta().custom_metadata_map
    assert {k: got[k] for k in meta} == meta
    from importlib.metadata import version

    assert (proto.producer_name, proto.producer_version) == ("leaflens-engine", version("leaflens"))
    assert convert_float16(proto).producer_version == version("leaflens")  # which leaflens made the file


def test_fp16_variant_agrees_and_keeps_float32_io():
    model = StudentCNN(6, widths=(8, 16))
    _randomise_bn(model)
    proto = export_onnx(model, (3, 16, 16))
    half = convert_float16(proto)
    assert {i.data_type for i in half.graph.initializer} == {onnx.TensorProto.FLOAT16}
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert half.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    x = np.random.default_rng(0).normal(size=(400, 3, 16, 16)).astype(np.float32)
    (full,) = _session(proto).run(None, {"input": x})
    (h,) = _session(half).run(None, {"input": x})
    assert h.dtype == np.float32
    assert np.abs(h - full).max() < 2e-2 * max(1.0, np.abs(full).max())
    top2 = np.sort(full, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-2  # leave out numerical ties
    assert (h.argmax(1) == full.argmax(1))[clear].mean() >= 0.995


def test_fp16_refuses_weights_beyond_its_range():
    lin = nn.Linear(4, 2)
    lin.weight.data[0, 0] = 1e6
    with pytest.raises(ExportError, match="weight.*beyond float16"):
        convert_float16(export_onnx(lin, (4,)))


def test_fp16_keeps_tiny_epsilons_positive():
    model = Fn(lambda s, x: ops.l2_normalize(s.l(x), eps=1e-12), l=nn.Linear(4, 3))
    half = convert_float16(export_onnx(model, (4,)))
    (out,) = _session(half).run(None, {"input": np.zeros((2, 4), np.float32) + 0.0})
    assert np.all(np.isfinite(out))


def test_unsupported_op_names_itself_and_the_module():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Fn(lambda s, x: ops.stack([x, x], axis=1))

        def forward(self, x):
            return self.body(x)

    with pytest.raises(UnsupportedOpError, match=r"engine op Stack .*module 'body'.*Exportable ops:.*Conv2d"):
        export_onnx(Picky(), (5,))
    with pytest.raises(UnsupportedOpError, match="GetItem"):
        export_onnx(Fn(lambda s, x: x[:, :2]), (5,))


def test_batch_mixing_ops_are_refused():
    with pytest.raises(ExportError, match="batch"):
        export_onnx(Fn(lambda s, x: x.reshape(-1)), (4,))
    with pytest.raises(ExportError, match="batch"):
        export_onnx(Fn(lambda s, x: ops.softmax(x, axis=0)), (4,))
    with pytest.raises(ExportError, match="batch"):
        export_onnx(Fn(lambda s, x: ops.mean(x, axis=0, keepdims=True) + x), (4,))


def test_export_needs_a_tensor_output_depending_on_the_input():
    with pytest.raises(ExportError, match=r"2 output\(s\) but 1 output name"):
        export_onnx(Fn(lambda s, x: (x, x)), (4,))
    with pytest.raises(ExportError, match="a Tensor or a tuple of Tensors"):
        export_onnx(Fn(lambda s, x: [x]), (4,))
    with pytest.raises(ExportError, match="distinct names"):
        export_onnx(Fn(lambda s, x: (x, x * 2.0)), (4,), output_name=("a", "a"))
    with pytest.raises(ExportError, match="does not depend on its input"):
        export_onnx(Fn(lambda s, x: s.l.weight * 2.0, l=nn.Linear(2, 2)), (4,))


def test_identity_model_exports():
    proto = export_onnx(Fn(lambda s, x: x), (4,))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(_session(proto).run(None, {"input": x})[0], x)


def test_constant_subgraphs_are_folded():
    # weight standardisation computed from parameters only: no node for it in the graph
    model = Fn(lambda s, x: ops.linear(x, s.l.weight / ops.sqrt(ops.sum(s.l.weight * s.l.weight))),
               l=nn.Linear(4, 3))
    proto, _ = roundtrip(model, (4,))
    assert _ops_of(proto) == ["Gemm"]


def test_a_tuple_forward_gives_one_named_output_each():
    proto = export_onnx(Fn(lambda s, x: (s.l(x), (x * x).sum(axis=1)), l=nn.Linear(4, 3)), (4,),
                        output_name=("logits", "score"))
    assert [o.name for o in proto.graph.output] == ["logits", "score"]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    logits, score = _session(proto).run(None, {"input": x})
    assert logits.shape == (2, 3)
    np.testing.assert_allclose(score, (x * x).sum(1), rtol=1e-6)


def _two_output_graph() -> onnx.ModelProto:
    """x -> h = Relu(x * 1) -> logits = h @ W; score = sum((h * 300)^2) (a squared distance that float16
    cannot hold for inputs of a few units); h is shared, the rest belongs to one output each."""
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "W")
    one = numpy_helper.from_array(np.ones(4, np.float32), "one")  # read by the shared node only
    scale = numpy_helper.from_array(np.full(4, 300.0, np.float32), "scale")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("Mul", ["x", "one"], ["x1"]), helper.make_node("Relu", ["x1"], ["h"]),
             helper.make_node("MatMul", ["h", "W"], ["logits"]), helper.make_node("Mul", ["h", "scale"], ["big"]),
             helper.make_node("ReduceSumSquare", ["big", "axes"], ["score"], keepdims=0)]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 3]),
                               helper.make_tensor_value_info("score", TensorProto.FLOAT, ["n"])],
                              [w, one, scale, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_float16_keeps_a_named_output_in_float32_where_it_would_overflow():
    from onnx.reference import ReferenceEvaluator  # noqa: PLC0415  (computes float16 in float16)

    proto = _two_output_graph()
    x = np.array([[1.0, 2.0, -1.0, 0.5], [0.1, 0.2, 0.3, 0.4]], np.float32)
    logits32, score32 = ReferenceEvaluator(proto).run(None, {"x": x})
    with np.errstate(over="ignore"):
        _, score16 = ReferenceEvaluator(convert_float16(proto)).run(None, {"x": x})
    assert np.isinf(score16[0])  # 300^2 * 5.25 = 472,500: beyond float16
    kept = convert_float16(proto, keep_float32=["score"])
    logits, score = ReferenceEvaluator(kept).run(None, {"x": x})
    np.testing.assert_allclose(score, score32, rtol=2e-3)  # only h's float16 rounding
    np.testing.assert_allclose(logits, logits32, rtol=2e-3, atol=1e-3)
    by_name = {i.name: i.data_type for i in kept.graph.initializer}
    assert by_name["scale"] == onnx.TensorProto.FLOAT and by_name["W"] == onnx.TensorProto.FLOAT16
    assert by_name["one"] == onnx.TensorProto.FLOAT16  # the shared part runs in float16
    assert "score in float32" in kept.doc_string
    with pytest.raises(ExportError, match="no graph output named"):
        convert_float16(proto, keep_float32=["nope"])
