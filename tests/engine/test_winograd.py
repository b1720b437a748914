"""Winograd F(2x2, 3x3) (engine/ops/winograd.py) computes what im2col + matmul does: forward, both gradients,
with any chunking and thread count, and only where it applies."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, ops, parallel
from leaflens.engine.gradcheck import gradcheck
from leaflens.engine.ops import winograd

rng = np.random.default_rng(11)


def _run(x, w, gy, *, winograd_on: bool, monkeypatch):
    monkeypatch.setattr(winograd, "MIN_CHANNELS", 1 if winograd_on else 1 << 30)
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    y = ops.conv2d(xt, wt, stride=1, padding=1)
    assert (y.creator.mode == "winograd") == winograd_on
    y.backward(gy)
    return y.data, xt.grad, wt.grad


@pytest.mark.parametrize("shape,cout", [((3, 4, 6, 5), 7), ((2, 8, 8, 16), 24), ((5, 2, 2, 3), 2), ((6, 8, 4, 4), 3)])
@pytest.mark.parametrize("chunk,piece", [(1, 256), (8, 2), (1 << 30, 256), (1 << 30, 2)])
def test_forward_and_gradients_equal_im2col_in_float32(shape, cout, chunk, piece, monkeypatch):
    # chunk 1: one image and one tile row per chunk; 8: blocks of a few images, chunks of one or more tile rows
    # (their input gradients overlap); 1 << 30: one chunk. piece 2: the products in 2-row pieces.
    monkeypatch.setattr(winograd, "CHUNK", chunk)
    monkeypatch.setattr(winograd, "PIECE", piece)
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)  # chunks go to the threads even at these sizes
    monkeypatch.setattr(parallel, "num_threads", lambda: 2)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((cout, shape[-1], 3, 3)) / np.sqrt(9 * shape[-1])).astype(np.float32)
    gy = rng.standard_normal((*shape[:3], cout)).astype(np.float32)
    got = _run(x, w, gy, winograd_on=True, monkeypatch=monkeypatch)
    want = _run(x, w, gy, winograd_on=False, monkeypatch=monkeypatch)
    for a, b, name in zip(got, want, ("y", "gx", "gw")):
        assert a.dtype == np.float32, name
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * scale * np.sqrt(9 * shape[-1]), err_msg=name)


def test_passes_gradcheck_in_float64(monkeypatch):
    monkeypatch.setattr(winograd, "MIN_CHANNELS", 1)
    monkeypatch.setattr(winograd, "CHUNK", 1)
    assert gradcheck(lambda x, w: ops.conv2d(x, w, stride=1, padding=1),
                     [rng.standard_normal((2, 4, 6, 3)), rng.standard_normal((4, 3, 3, 3))])


def test_weight_gradient_does_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(winograd, "CHUNK", 1)
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    x = rng.standard_normal((6, 4, 4, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((6, 4, 4, 8)).astype(np.float32)
    grads = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(parallel, "num_threads", lambda t=threads: t)
        grads.append(_run(x, w, gy, winograd_on=True, monkeypatch=monkeypatch)[1:])
    for g in grads[1:]:
        np.testing.assert_array_equal(g[0], grads[0][0])
        np.testing.assert_array_equal(g[1], grads[0][1])


def test_only_3x3_stride_1_pad_1_even_numpy_float_with_enough_channels():
    x = np.zeros((1, 8, 8, 16), np.float32)
    w = np.zeros((4, 16, 3, 3), np.float32)
    ok = dict(stride=(1, 1), pads=(1, 1, 1, 1), groups=1)
    assert winograd.applies(x, w, **ok)
    assert not winograd.applies(x[:, :7], w, **ok)  # odd height
    assert not winograd.applies(x[..., :3], w[:, :3], **ok)  # too few input channels (the student's first layer)
    assert not winograd.applies(x.astype(np.float16), w.astype(np.float16), **ok)
    assert not winograd.applies(x, w[:, :, :1, :1], **ok)
    assert not winograd.applies(x, w, **{**ok, "stride": (2, 2)})
    assert not winograd.applies(x, w, **{**ok, "pads": (0, 1, 0, 1)})
    assert not winograd.applies(x, w[:, :8], **{**ok, "groups": 2})


def test_filter_transform_and_its_gradient_are_adjoint():
    """<transform_filter(w), dU> = <w, filter_grad(dU)>, whatever order the planes are kept in."""
    w = rng.standard_normal((5, 4, 3, 3))
    du = rng.standard_normal((16, 4, 5))
    assert np.isclose(np.sum(winograd.transform_filter(w) * du), np.sum(w * winograd.filter_grad(du, w.shape)))
    assert sorted(winograd.ORDER) == list(range(16))
