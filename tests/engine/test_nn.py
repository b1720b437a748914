"""Modules: parameter discovery, buffers, modes, state dicts, hooks, and a model that overfits."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, nn, ops
from leaflens.engine.optim import Adam


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.GlobalAvgPool2d(), nn.Linear(4, 2))

    def forward(self, x):
        return self.head(ops.relu(self.bn(self.conv(x))))


def test_parameters_and_buffers_are_kept_apart():
    m = Tiny()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "head.1.weight", "head.1.bias"]
    assert [n for n, _ in m.named_buffers()] == ["bn.running_mean", "bn.running_var"]
    sd = m.state_dict()
    assert set(sd) == set(names) | {"bn.running_mean", "bn.running_var"}


def test_train_eval_switches_every_submodule():
    m = Tiny().eval()
    assert all(not s.training for s in m.modules())
    m.train()
    assert all(s.training for s in m.modules())


def test_batchnorm_running_statistics_and_eval_mode():
    bn = nn.BatchNorm2d(2, momentum=0.5)
    x = np.random.default_rng(0).normal(3.0, 2.0, (8, 4, 4, 2)).astype(np.float32)
    bn(Tensor(x))
    flat = x.reshape(-1, 2)
    np.testing.assert_allclose(bn.running_mean, 0.5 * flat.mean(0), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var, 0.5 + 0.5 * flat.var(0, ddof=1), rtol=1e-5)
    bn.eval()
    y = bn(Tensor(x)).data
    expect = (x - bn.running_mean) / np.sqrt(bn.running_var + bn.eps)
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-5)


def test_load_state_dict_round_trip():
    a, b = Tiny(), Tiny()
    b.load_state_dict(a.state_dict())
    x = Tensor(np.random.randn(2, 5, 5, 3).astype(np.float32))
    a.eval(), b.eval()
    np.testing.assert_array_equal(a(x).data, b(x).data)


def test_load_state_dict_refuses_wrong_shape_naming_the_key():
    m = Tiny()
    sd = m.state_dict()
    sd["head.1.weight"] = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"'head.1.weight'.*\(3, 4\).*\(2, 4\)"):
        m.load_state_dict(sd)


def test_load_state_dict_strict_names_missing_and_unexpected_keys():
    m = Tiny()
    sd = m.state_dict()
    sd.pop("bn.running_var")
    sd["extra.weight"] = np.zeros(1)
    with pytest.raises(KeyError, match="missing keys: bn.running_var.*unexpected keys: extra.weight"):
        m.load_state_dict(sd)
    assert m.load_state_dict(sd, strict=False) == ["bn.running_var"]


def test_forward_hooks_capture_and_can_be_removed():
    m = Tiny()
    seen = []
    remove = m.conv.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    m(Tensor(np.zeros((1, 5, 5, 3), np.float32)))
    remove()
    m(Tensor(np.zeros((1, 5, 5, 3), np.float32)))
    assert seen == [(1, 5, 5, 4)]


def test_initialisers_have_the_expected_scale():
    w = nn.init.kaiming_normal((256, 128, 3, 3), "relu", mode="fan_in")
    assert abs(w.std() - np.sqrt(2 / (128 * 9))) < 0.01 * np.sqrt(2 / (128 * 9)) * 10
    x = nn.init.xavier_uniform((300, 200))
    assert abs(x.max()) <= np.sqrt(6 / 500) + 1e-7


def test_a_small_cnn_overfits_32_examples():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 4, 32)
    init = np.random.default_rng(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, rng=init), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1, rng=init), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.GlobalAvgPool2d(), nn.Linear(32, 4, rng=init))
    opt = Adam(model.parameters(), lr=0.01)
    for _ in range(150):
        opt.zero_grad()
        loss = ops.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()
    model.eval()
    acc = (model(Tensor(x)).data.argmax(1) == y).mean()
    assert acc == 1.0, f"train accuracy {acc}, final loss {loss.item()}"


class _Trap:
    """Stands in for the engine's interactive fallback stream: any draw from it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"drew from the engine's default generator ({name})")


def test_layers_and_dropout_draw_only_from_the_generator_they_are_given(monkeypatch):
    from leaflens.engine import random as erandom  # noqa: PLC0415

    def build(seed):
        rng = np.random.default_rng(seed)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, rng=rng), nn.GlobalAvgPool2d(), nn.Dropout(0.5, rng=rng),
                             nn.Linear(4, 2, rng=rng))

    monkeypatch.setattr(erandom, "_default", _Trap())
    x = Tensor(np.ones((6, 5, 5, 3), np.float32))
    a, b, c = build(1), build(1), build(2)
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(v, b.state_dict()[k])
    assert not np.array_equal(a.state_dict()["0.weight"], c.state_dict()["0.weight"])
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())  # the same dropout masks too
    inits = [nn.init.kaiming_uniform((3, 4), rng=np.random.default_rng(0)) for _ in range(2)]
    np.testing.assert_array_equal(*inits)


def test_rng_none_is_the_interactive_default_stream():
    from leaflens.engine import random as erandom  # noqa: PLC0415

    erandom.seed(4)
    first = nn.Linear(3, 2).weight.data.copy()
    erandom.seed(4)
    np.testing.assert_array_equal(nn.Linear(3, 2).weight.data, first)
    assert erandom.generator(None) is erandom.default_generator()
    given = np.random.default_rng(1)
    assert erandom.generator(given) is given
    np.testing.assert_array_equal(erandom.generator(3).random(2), np.random.default_rng(3).random(2))


def test_set_dropout_generator_points_every_dropout_at_one_generator():
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 4, rng=np.random.default_rng(0)), nn.Dropout(0.3))
    assert nn.set_dropout_generator(model, np.random.default_rng(8)) == 2
    x = Tensor(np.ones((5, 4), np.float32))
    first = model(x).numpy()
    nn.set_dropout_generator(model, np.random.default_rng(8))
    np.testing.assert_array_equal(model(x).numpy(), first)
    nn.set_dropout_generator(model, np.random.default_rng(9))
    assert not np.array_equal(model(x).numpy(), first)


def test_dropout_on_float16_input_draws_in_float32_and_keeps_the_dtype():
    """NumPy cannot draw float16 uniforms: the mask is drawn in float32 and cast, so a float16 input gets
    the very mask a float32 input gets from the same generator state, and the gradient follows it."""
    x32 = np.random.default_rng(0).uniform(0.5, 2.0, (64, 32)).astype(np.float32)
    x16 = Tensor(x32.astype(np.float16), requires_grad=True)
    y16 = ops.dropout(x16, 0.25, rng=np.random.default_rng(5))
    y32 = ops.dropout(Tensor(x32), 0.25, rng=np.random.default_rng(5))
    assert y16.dtype == np.float16
    kept = y16.numpy() != 0
    np.testing.assert_array_equal(kept, y32.numpy() != 0)
    assert 0.65 < kept.mean() < 0.85  # about 1 - p of the values survive
    np.testing.assert_allclose(y16.numpy()[kept], (x32.astype(np.float16) / np.float16(0.75))[kept], rtol=1e-3)
    y16.sum().backward()
    assert x16.grad.dtype == np.float16
    np.testing.assert_array_equal(x16.grad != 0, kept)
    np.testing.assert_allclose(x16.grad[kept], 1 / 0.75, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dropout_on_the_device_draws_there_from_the_given_generator(dtype):
    from leaflens.engine.backend import to_device  # noqa: PLC0415

    x = Tensor(to_device(np.ones((256, 64), dtype), "cuda"))
    masks = [ops.dropout(x, 0.3, rng=np.random.default_rng(s)).data for s in (4, 4, 5)]
    assert type(masks[0]) is type(x.data) and masks[0].dtype == dtype  # noqa: E721  (still a device array)
    a, b, c = (to_device(m, "cpu") != 0 for m in masks)
    np.testing.assert_array_equal(a, b)  # the same generator state gives the same mask
    assert not np.array_equal(a, c)
    assert 0.67 < a.mean() < 0.73
