"""INT8 quantisation options (leaflens.pipeline.export.quantize): recipes, the layers kept in float,
the calibration methods, and the rule that decides whether an INT8 model is worth writing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import numpy_helper  # noqa: E402

from leaflens.engine.onnx_export import export_onnx, save_onnx  # noqa: E402
from leaflens.pipeline.export.parity import cpu_session, onnx_logits  # noqa: E402
from leaflens.pipeline.export.quantize import (  # noqa: E402
    Int8Recipe,
    float_nodes,
    int8_ladder,
    int8_shortfall,
    quantize_int8,
)
from leaflens.pipeline.models.student import StudentCNN  # noqa: E402
from leaflens.records import RecordError  # noqa: E402

SIZE = 16
MEAN = np.array([0.45, 0.5, 0.4], np.float32)
STD = np.array([0.25, 0.2, 0.22], np.float32)
ALL_QUANTISED = Int8Recipe(calibration="minmax", float_first_conv=False, float_classifier=False)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> Path:
    """A small StudentCNN (random weights, fixed seed) exported to ONNX FP32."""
    from leaflens.engine import random as erandom  # noqa: PLC0415

    erandom.seed(3)
    model = StudentCNN(3, widths=(8, 16))
    model.eval()
    path = tmp_path_factory.mktemp("quant") / "student.onnx"
    save_onnx(export_onnx(model, (3, SIZE, SIZE), metadata={"leaflens.test": "1"}, graph_name="g"), path)
    return path


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """Textured images with a few bright outliers (what min/max ranges are sensitive to)."""
    rng = np.random.default_rng(0)
    x = rng.normal(120, 30, (48, SIZE, SIZE, 3))
    x[::8, 3, 3, :] = 255  # one saturated pixel in every eighth image
    return np.clip(x, 0, 255).astype(np.uint8)


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path)).graph


def _quantised_inputs(graph: onnx.GraphProto) -> dict[str, list[bool]]:
    """Per compute node (by name): for each input, whether it comes out of a DequantizeLinear."""
    from_dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name: [i in from_dq for i in n.input] for n in graph.node
            if n.op_type not in ("QuantizeLinear", "DequantizeLinear")}


def _producer(graph: onnx.GraphProto, tensor: str) -> str:
    (op,) = [n.op_type for n in graph.node if tensor in n.output]
    return op


def test_the_first_conv_and_the_classifier_are_found_by_name(fp32):
    model = onnx.load(str(fp32))
    assert float_nodes(model, True, True) == ["/features/0/0/Conv", "/classifier/Gemm"]
    assert float_nodes(model, True, False) == ["/features/0/0/Conv"]
    assert float_nodes(model, False, False) == []
    model.graph.node[0].name = ""
    with pytest.raises(ValueError, match="unnamed Conv"):
        float_nodes(model, True, False)


def test_kept_layers_stay_float_and_the_rest_is_quantised(fp32, images, tmp_path):
    q = quantize_int8(fp32, tmp_path / "q.onnx", images, MEAN, STD, Int8Recipe(calib_images=48, float_first_conv=True))
    assert q.float_nodes == ("/features/0/0/Conv", "/classifier/Gemm") and q.calibration_images == 48
    graph = _graph(q.path)
    inputs = _quantised_inputs(graph)
    assert inputs["/features/0/0/Conv"] == [False, False, False]  # raw input, float weight and bias
    assert inputs["/classifier/Gemm"][1:] == [False, False]  # float weight and bias ...
    assert _producer(graph, graph.output[0].name) == "Gemm"  # ... and float logits
    assert all(inputs["/features/1/0/Conv"][:2])  # activation and weight quantised
    everything = quantize_int8(fp32, tmp_path / "all.onnx", images, MEAN, STD, ALL_QUANTISED)
    assert everything.float_nodes == ()
    graph = _graph(everything.path)
    inputs = _quantised_inputs(graph)
    assert all(inputs["/features/0/0/Conv"][:2]) and all(inputs["/classifier/Gemm"][:2])
    assert _producer(graph, graph.output[0].name) == "DequantizeLinear"  # the logits are quantised too
    # both carry the FP32 model card and are valid ONNX (quantize_int8 runs the full checker)
    assert {p.key: p.value for p in onnx.load(str(q.path)).metadata_props} == {"leaflens.test": "1"}


def _activation_scales(path: Path) -> dict[str, float]:
    graph = _graph(path)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    return {n.input[0]: float(inits[n.input[1]]) for n in graph.node if n.op_type == "QuantizeLinear"}


def test_percentile_ranges_clip_outliers_that_minmax_keeps(fp32, images, tmp_path):
    minmax = quantize_int8(fp32, tmp_path / "mm.onnx", images, MEAN, STD, ALL_QUANTISED)
    pct = quantize_int8(fp32, tmp_path / "pct.onnx", images, MEAN, STD,
                        replace(ALL_QUANTISED, calibration="percentile", percentile=99.9))
    a, b = _activation_scales(minmax.path), _activation_scales(pct.path)
    assert set(a) == set(b) and a
    assert all(b[k] <= a[k] * (1 + 1e-6) for k in a)  # a percentile range never exceeds the extremes
    assert b["input"] < a["input"]  # the saturated pixels widen the input's min/max range only


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_every_calibration_method_gives_a_model_close_to_fp32(fp32, images, tmp_path, method):
    q = quantize_int8(fp32, tmp_path / f"{method}.onnx", images, MEAN, STD,
                      Int8Recipe(calibration=method, calib_images=48))
    want = onnx_logits(cpu_session(fp32, 1), images, MEAN, STD)
    got = onnx_logits(cpu_session(q.path, 1), images, MEAN, STD)
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max() + 1e-3


def test_calibration_uses_every_image_given_even_an_odd_count(fp32, images, tmp_path):
    """The histogram calibrators need equal batches: 37 images (a prime) are still all used."""
    q = quantize_int8(fp32, tmp_path / "odd.onnx", images[:37], MEAN, STD,
                      Int8Recipe(calibration="percentile", calib_images=37))
    assert q.calibration_images == 37 and q.path.exists()


def test_per_tensor_weights_have_one_scale(fp32, images, tmp_path):
    def weight_scale_sizes(path: Path) -> set[int]:
        graph = _graph(path)
        inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        return {inits[n.input[1]].size for n in graph.node
                if n.op_type == "DequantizeLinear" and n.input[0].endswith("weight_bn_folded_quantized")}

    per_channel = quantize_int8(fp32, tmp_path / "pc.onnx", images, MEAN, STD, ALL_QUANTISED)
    per_tensor = quantize_int8(fp32, tmp_path / "pt.onnx", images, MEAN, STD, replace(ALL_QUANTISED, per_channel=False))
    assert weight_scale_sizes(per_channel.path) == {8, 16}
    assert weight_scale_sizes(per_tensor.path) == {1}


def test_7_bit_weights_are_what_no_cpu_saturates(fp32, images, tmp_path):
    """x86 CPUs without VNNI sum uint8 x int8 products in pairs into 16 bits: 255 * 127 * 2 overflows it, 255 * 64
    * 2 does not. reduce_range keeps every quantised weight within -64..64; the default uses all 8 bits."""
    def weight_range(path: Path) -> tuple[int, int]:
        graph = _graph(path)
        inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        ws = [inits[n.input[0]] for n in graph.node
              if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None
              and inits[n.input[0]].dtype == np.int8 and inits[n.input[0]].ndim == 4]
        return min(int(w.min()) for w in ws), max(int(w.max()) for w in ws)

    seven = quantize_int8(fp32, tmp_path / "w7.onnx", images, MEAN, STD, replace(ALL_QUANTISED, reduce_range=True))
    eight = quantize_int8(fp32, tmp_path / "w8.onnx", images, MEAN, STD, ALL_QUANTISED)
    lo, hi = weight_range(seven.path)
    assert -64 <= lo and hi <= 64 and hi - lo > 100  # the 7-bit range, used
    lo, hi = weight_range(eight.path)
    assert lo < -64 or hi > 64
    assert "8-bit weights" in Int8Recipe().describe()
    assert "7-bit weights" in Int8Recipe(reduce_range=True).describe()


def test_the_rule_allows_at_most_the_given_drop():
    assert int8_shortfall(0.95, 0.95, 0.01) is None
    assert int8_shortfall(0.95, 0.94, 0.01) is None  # exactly one point, despite float rounding
    assert int8_shortfall(0.90, 0.97, 0.01) is None  # better is fine
    reason = int8_shortfall(0.95, 0.9390, 0.01)
    assert reason is not None and "93.90%" in reason and "95.00%" in reason and "1.1 points" in reason
    assert int8_shortfall(0.95, 0.90, 0.06) is None
    assert int8_shortfall(0.95, float("nan"), 0.01) is not None


def test_the_ladder_tries_the_fast_recipe_first():
    fast, accurate = int8_ladder()
    assert fast == Int8Recipe() and not fast.float_first_conv and fast.float_classifier
    assert accurate == replace(fast, float_first_conv=True)
    base = Int8Recipe(calibration="entropy", calib_images=64)
    assert int8_ladder(base) == (base, replace(base, float_first_conv=True))
    already = replace(base, float_first_conv=True)
    assert int8_ladder(already) == (already,)


def test_recipes_are_checked_and_round_trip():
    r = Int8Recipe(calibration="entropy", calib_images=64, per_channel=False)
    assert Int8Recipe.from_dict(r.to_dict()) == r
    assert "entropy ranges, per-tensor 8-bit weights" in r.describe()
    with pytest.raises(RecordError, match="calibration"):
        Int8Recipe.from_dict({"calibration": "kl"})
    with pytest.raises(RecordError, match="unknown key 'calib'"):
        Int8Recipe.from_dict({"calib": 3})
    for bad in ({"calib_images": 0}, {"percentile": 0.0}, {"percentile": 101.0}, {"activations": "int4"}):
        with pytest.raises(ValueError):
            Int8Recipe(**bad)  # type: ignore[arg-type]


def test_export_options_make_the_recipes_tried():
    import argparse  # noqa: PLC0415

    from leaflens.pipeline.cli import export as export_cli  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    export_cli.add_parser(parser.add_subparsers())
    assert export_cli.int8_recipes(parser.parse_args(["export"])) == int8_ladder()
    assert export_cli.int8_recipes(parser.parse_args(["export", "--int8-float-first-conv", "no"])) == (Int8Recipe(),)
    args = parser.parse_args(["export", "--int8-float-first-conv", "yes", "--int8-calibration", "percentile",
                              "--int8-percentile", "99.9", "--calib-images", "64", "--no-int8-per-channel",
                              "--no-int8-float-classifier", "--int8-activations", "int8", "--int8-weight-bits", "7"])
    assert export_cli.int8_recipes(args) == (Int8Recipe(calibration="percentile", percentile=99.9, calib_images=64,
                                                        per_channel=False, float_first_conv=True,
                                                        float_classifier=False, activations="int8",
                                                        reduce_range=True),)
