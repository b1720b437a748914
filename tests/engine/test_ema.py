"""The weight average (ModelEMA): its arithmetic, its swap in and out of a model, and its checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, nn
from leaflens.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from leaflens.engine.optim import ModelEMA


class _Net(nn.Module):
    def __init__(self, seed: int = 0, width: int = 3) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.conv = nn.Conv2d(2, width, 3, padding=1, rng=rng)
        self.bn = nn.BatchNorm2d(width)
        self.register_buffer("count", np.zeros((), np.int64))

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in model.state_dict().items()}


def _perturb(model: nn.Module, rng: np.random.Generator) -> None:
    for p in model.parameters():
        p.data += rng.standard_normal(p.data.shape).astype(p.data.dtype)
    model.bn.running_mean += 1.0
    model.count[...] += 1


def _averaged(seed: int, decay: float, steps: int) -> tuple[_Net, ModelEMA, np.random.Generator]:
    """A model trained by ``steps`` random moves, with its average updated after each."""
    model, rng = _Net(), np.random.default_rng(seed)
    ema = ModelEMA(model, decay)
    for _ in range(steps):
        _perturb(model, rng)
        ema.update(model)
    return model, ema, rng


def test_update_follows_the_warm_up_then_the_decay():
    model, rng = _Net(), np.random.default_rng(1)
    ema = ModelEMA(model, 0.9)
    expected = _params(model)
    for n in range(1, 100):
        _perturb(model, rng)
        d = min(0.9, (1 + n) / (10 + n))
        assert ema.current_decay() == pytest.approx(d)
        ema.update(model)
        live = _params(model)
        for k in expected:
            expected[k] = live[k] if k == "count" else d * expected[k] + (1 - d) * live[k]
    assert ema.updates == 99 and ema.current_decay() == 0.9
    for k, v in expected.items():
        np.testing.assert_allclose(ema.shadow[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    assert int(ema.shadow["count"]) == 99  # integer buffers are copied, not averaged


def test_applied_swaps_the_average_in_and_the_live_weights_back():
    model, ema, rng = _averaged(2, 0.5, 5)
    live = _params(model)
    x = Tensor(rng.standard_normal((2, 4, 4, 2)).astype(np.float32))  # NHWC
    model.eval()
    with ema.applied(model) as m:
        inside = _params(m)
        out_avg = m(x).numpy()
    for k in live:
        np.testing.assert_array_equal(inside[k], ema.shadow[k], err_msg=k)
        np.testing.assert_array_equal(model.state_dict()[k], live[k], err_msg=k)
    assert not np.allclose(out_avg, model(x).numpy())
    with pytest.raises(RuntimeError), ema.applied(model):  # an error inside still gives the live weights back
        raise RuntimeError("boom")
    for k in live:
        np.testing.assert_array_equal(model.state_dict()[k], live[k], err_msg=k)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model, ema, rng = _averaged(3, 0.99, 3)
    save_checkpoint(tmp_path / "a.npz", model, ema=ema)
    other = ModelEMA(_Net(seed=5), 0.5)
    load_checkpoint(tmp_path / "a.npz", ema=other)
    assert other.decay == 0.99 and other.updates == 3
    for k, v in ema.shadow.items():
        np.testing.assert_array_equal(other.shadow[k], v, err_msg=k)
    save_checkpoint(tmp_path / "plain.npz", model)
    with pytest.raises(CheckpointError, match="no weight average"):
        load_checkpoint(tmp_path / "plain.npz", ema=other)
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(tmp_path / "a.npz", ema=ModelEMA(_Net(width=4), 0.9))


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ValueError, match="decay"):
        ModelEMA(_Net(), decay)


def test_restart_begins_again_from_the_model():
    model, ema, rng = _averaged(4, 0.9, 3)
    _perturb(model, rng)
    ema.restart(model)
    assert ema.updates == 0
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(ema.shadow[k], v, err_msg=k)
