"""Edge cases of the engine's semantics a user of the library meets: integer tensors beside floats, shared
modules in the state dict, non-finite float32 gradients, masked logits, smoothing of soft targets, empty
batches, and states that fail to load leaving everything as it was."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import NonFiniteLossError, Tensor, nn, ops
from leaflens.engine.amp import GradScaler, train_step
from leaflens.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from leaflens.engine.nn import Parameter
from leaflens.engine.optim import SGD, Adam


# ---- integers beside floats ------------------------------------------------------------------------------
def test_a_fractional_scalar_beside_an_integer_tensor_is_not_truncated():
    pixels = Tensor(np.array([[200, 100]], np.uint8))
    np.testing.assert_allclose((pixels * (1 / 255)).data, [[200 / 255, 100 / 255]], rtol=1e-6)
    np.testing.assert_allclose((pixels - 127.5).data, [[72.5, -27.5]])  # no wrap-around in uint8
    assert (pixels * (1 / 255)).dtype == np.float32  # the engine's float, as for Tensor(0.5)
    counts = Tensor(np.array([1, 2, 3]))
    np.testing.assert_allclose((counts + 0.5).data, [1.5, 2.5, 3.5])
    np.testing.assert_allclose((0.5 * counts).data, [0.5, 1.0, 1.5])
    assert (counts + 1).dtype == counts.dtype  # integers stay integers


def test_an_integer_tensor_takes_the_float_dtype_of_the_other_operand():
    w = Tensor(np.array([0.5, 2.0], np.float32), requires_grad=True)
    y = Tensor(np.array([1, 2])) * w
    assert y.dtype == np.float32  # not NumPy's float64, which the next float32 op would refuse
    (y + w).sum().backward()
    np.testing.assert_allclose(w.grad, [2.0, 3.0])
    assert ops.maximum(Tensor(np.array([1, 5])), w).dtype == np.float32


def test_only_float_tensors_can_require_grad():
    with pytest.raises(TypeError, match="floating-point"):
        Tensor(np.array([1, 2, 3]), requires_grad=True)
    x = Tensor(np.array([1.5, 2.5], np.float32), requires_grad=True)
    assert not ops.cast(x, np.int32).requires_grad  # a cast to int has no gradient


# ---- shared modules ----------------------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.enc = nn.Linear(4, 4, rng=np.random.default_rng(seed))
        self.dec = self.enc  # the same module twice
        self.bn = nn.BatchNorm2d(2)
        self.bn_again = self.bn


class _TiedWeight(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.enc = nn.Linear(4, 4, rng=np.random.default_rng(seed))
        self.dec = nn.Linear(4, 4, rng=np.random.default_rng(seed + 1))
        self.dec.weight = self.enc.weight  # one parameter in two modules


@pytest.mark.parametrize("cls", [_Tied, _TiedWeight])
def test_a_model_with_shared_parts_loads_its_own_state(cls, tmp_path):
    saved = cls(0)
    state = saved.state_dict()
    assert len(state) == len(set(id(p) for p in saved.parameters())) + len(list(saved.named_buffers()))
    fresh = cls(5)
    fresh.load_state_dict(state)
    for (name, a), (_, b) in zip(saved.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)
    assert fresh.dec.weight is fresh.enc.weight  # still shared after loading
    save_checkpoint(tmp_path / "t.npz", saved)
    load_checkpoint(tmp_path / "t.npz", cls(7))


# ---- non-finite float32 gradients --------------------------------------------------------------------------
def test_float32_step_without_clipping_refuses_non_finite_gradients():
    p = Parameter(np.array([0.0, 1.0], np.float32))
    before = p.data.copy()
    with np.errstate(divide="ignore"), pytest.raises(NonFiniteLossError, match="not finite"):
        train_step(SGD([p], lr=0.1), GradScaler(enabled=False), lambda: ops.sqrt(p).sum())  # d/dp at 0 is inf
    np.testing.assert_array_equal(p.data, before)  # the optimiser was not touched
    q = Parameter(np.array([1.0, 4.0], np.float32))
    result = train_step(SGD([q], lr=0.1), GradScaler(enabled=False), lambda: ops.sqrt(q).sum())
    assert result.stepped
    np.testing.assert_allclose(q.data, [1.0 - 0.05, 4.0 - 0.025])


# ---- cross-entropy -----------------------------------------------------------------------------------------
def test_cross_entropy_with_a_masked_class_is_finite():
    z = Tensor(np.array([[-np.inf, 0.0, 0.0]], np.float32), requires_grad=True)
    loss = ops.cross_entropy(z, np.array([1]))
    np.testing.assert_allclose(loss.item(), np.log(2), rtol=1e-6)
    soft = ops.cross_entropy(z, np.array([[0.0, 0.5, 0.5]], np.float32))
    np.testing.assert_allclose(soft.item(), np.log(2), rtol=1e-6)
    soft.backward()
    np.testing.assert_allclose(z.grad, [[0.0, 0.0, 0.0]], atol=1e-7)
    # target mass on the masked class: the loss is infinite, as it should be
    with np.errstate(invalid="ignore"):
        assert np.isinf(ops.cross_entropy(z, np.array([0])).item())


def test_label_smoothing_applies_to_soft_targets():
    z = Tensor(np.array([[2.0, 0.0, -1.0]], np.float32))
    onehot = np.array([[1.0, 0.0, 0.0]], np.float32)
    smoothed_by_hand = onehot * 0.7 + 0.1
    assert ops.cross_entropy(z, onehot, label_smoothing=0.3).item() == pytest.approx(
        ops.cross_entropy(z, smoothed_by_hand).item(), rel=1e-6)
    assert ops.cross_entropy(z, onehot, label_smoothing=0.3).item() == pytest.approx(
        ops.cross_entropy(z, np.array([0]), label_smoothing=0.3).item(), rel=1e-6)


def test_empty_batches():
    z = Tensor(np.zeros((0, 3), np.float32), requires_grad=True)
    assert ops.cross_entropy(z, np.zeros((0, 3), np.float32)).item() == 0.0
    assert ops.cross_entropy(z, np.zeros(0, np.int64)).item() == 0.0
    x = Tensor(np.zeros((0, 4, 4, 16), np.float32), requires_grad=True)  # 16 channels: the Winograd size
    w = Tensor(np.ones((4, 16, 3, 3), np.float32), requires_grad=True)
    y = ops.conv2d(x, w, padding=1)
    assert y.shape == (0, 4, 4, 4)
    y.sum().backward()
    assert x.grad.shape == x.shape and not w.grad.any()


# ---- small gradients ----------------------------------------------------------------------------------------
def test_gradient_of_x_to_the_zero_is_zero_at_zero():
    x = Tensor(np.array([0.0, 2.0]), requires_grad=True)
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad, [0.0, 0.0])


def test_leaky_relu_refuses_a_slope_its_backward_cannot_follow():
    with pytest.raises(ValueError, match="slope"):
        ops.leaky_relu(Tensor(np.ones(2, np.float32)), -0.5)
    with pytest.raises(ValueError, match="negative_slope"):
        nn.LeakyReLU(1.5)


# ---- failed loads change nothing ---------------------------------------------------------------------------
def test_an_optimiser_state_that_fails_to_load_changes_nothing():
    params = [Parameter(np.ones(2, np.float32)), Parameter(np.ones(3, np.float32))]
    opt = Adam(params, lr=1e-3)
    for p in params:
        p.grad = np.ones_like(p.data)
    opt.step()
    good = opt.state_dict()
    bad = {"meta": {**good["meta"], "groups": [dict(g, lr=123.0) for g in good["meta"]["groups"]]},
           "arrays": {**good["arrays"], "1.exp_avg": np.zeros(5, np.float32)}}
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 1e-3
    after = opt.state_dict()
    assert sorted(after["arrays"]) == sorted(good["arrays"])
    for k, v in good["arrays"].items():
        np.testing.assert_array_equal(after["arrays"][k], v)


def test_a_checkpoint_that_fails_to_load_leaves_the_model_as_it_was(tmp_path):
    src = nn.Linear(3, 2, rng=np.random.default_rng(0))
    save_checkpoint(tmp_path / "no_optim.npz", src)  # no optimiser state in it
    target = nn.Linear(3, 2, rng=np.random.default_rng(1))
    before = target.state_dict()
    with pytest.raises(CheckpointError, match="no optimiser state"):
        load_checkpoint(tmp_path / "no_optim.npz", target, optimizer=SGD(target.parameters(), lr=0.1))
    for k, v in before.items():
        np.testing.assert_array_equal(target.state_dict()[k], v)
    other_opt = Adam(nn.Linear(3, 2).parameters(), lr=1e-3)  # Adam state for an SGD optimiser: refused
    save_checkpoint(tmp_path / "adam.npz", src, optimizer=other_opt)
    with pytest.raises(CheckpointError, match="Adam"):
        load_checkpoint(tmp_path / "adam.npz", target, optimizer=SGD(target.parameters(), lr=0.1))
    for k, v in before.items():
        np.testing.assert_array_equal(target.state_dict()[k], v)


# ---- traps a student falls into (reported by a user of the engine as a library) --------------------------
def test_in_place_updates_change_the_parameter_and_keep_it_a_parameter():
    """Without in-place operators, ``p -= lr * p.grad`` in a loop rebound a local name (nothing updated) and
    ``layer.weight -= ...`` put a plain Tensor where the parameter was (gone from parameters() and the
    checkpoints), both silently."""
    from leaflens.engine import no_grad

    lin = nn.Linear(3, 1, rng=np.random.default_rng(0))
    w0 = lin.weight.data.copy()
    ops.mse_loss(lin(Tensor(np.ones((2, 3), np.float32))), np.zeros((2, 1), np.float32)).backward()
    with no_grad():
        for p in lin.parameters():
            p -= 0.1 * p.grad
    np.testing.assert_allclose(lin.weight.data, w0 - 0.1 * lin.weight.grad, rtol=1e-6)
    with no_grad():
        lin.weight -= 0.1 * lin.weight.grad
    assert isinstance(lin.weight, Parameter) and [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    with pytest.raises(RuntimeError, match="under no_grad"):
        lin.weight -= 1.0  # a parameter, where autograd records: refused
    t = Tensor(np.ones(3, np.float32))
    buffer = t.data
    with no_grad():
        t *= 2
        t /= np.array([1, 2, 4], np.float32)
    np.testing.assert_array_equal(buffer, [2, 1, 0.5])  # in place: the same array
    with pytest.raises(ValueError, match="change the shape"):
        t += np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="float32 values in a int64 tensor"):
        n = Tensor(np.ones(3, np.int64))
        n += 0.5
    with pytest.raises(TypeError, match="mismatched dtypes"):
        half = Tensor(np.ones(2, np.float16))
        half += Tensor(np.full(2, 70000, np.float32))
    with pytest.raises(TypeError, match="cannot put a Tensor in Linear.weight, a parameter"):
        lin.weight = Tensor(np.zeros((1, 3), np.float32))
    lin.bias = None  # removing a parameter stays allowed
    assert [n for n, _ in lin.named_parameters()] == ["weight"]


def test_in_place_where_autograd_records_keeps_the_graph_whole():
    """A running loss (loss += term) and a term that needs gradients added into a plain tensor worked before
    in-place operators existed (Python's x = x + y) and must keep working; a tensor a graph saved must not
    change under it; a read-only memmap divided in place gives a new tensor."""
    from leaflens.engine import no_grad

    w = Parameter(np.ones(3, np.float32))
    loss = 0
    for i in range(3):
        loss += (w * float(i)).sum()
    loss.backward()
    np.testing.assert_array_equal(w.grad, [3, 3, 3])

    w = Parameter(np.ones(3, np.float32))
    reg = Tensor(np.float32(0.0))
    reg += (w * w).sum()
    ((w * 2).sum() + reg).backward()
    np.testing.assert_array_equal(w.grad, [4, 4, 4])

    w = Parameter(np.ones(3, np.float32))
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    loss = (w * x).sum()
    x += 10  # a new x: the graph's saved one is left as it was
    loss.backward()
    np.testing.assert_array_equal(w.grad, [1, 2, 3])

    frozen = np.arange(3, dtype=np.float32)
    frozen.flags.writeable = False
    t = Tensor(frozen)
    with no_grad():
        t /= 2
    np.testing.assert_array_equal(t.data, [0, 0.5, 1])
    np.testing.assert_array_equal(frozen, [0, 1, 2])


def test_to_the_same_device_is_the_tensor_and_gradients_flow_through_it():
    rng = np.random.default_rng(0)
    l1, l2 = nn.Linear(3, 3, rng=rng), nn.Linear(3, 1, rng=rng)
    h = l1(Tensor(np.ones((2, 3), np.float32)))
    assert h.to("cpu") is h
    l2(h.to("cpu")).sum().backward()
    assert l1.weight.grad is not None and np.abs(l1.weight.grad).sum() > 0


def test_equality_is_element_by_element_like_the_other_comparisons():
    t = Tensor(np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(t == 1.0, [True, False])
    np.testing.assert_array_equal(t != np.array([1.0, 3.0]), [False, True])
    assert float((t == Tensor(np.array([1.0, 2.0]))).mean()) == 1.0
    assert len({t, Tensor(t.data)}) == 2  # still hashable by identity (sets and dicts of parameters)


def test_an_empty_batch_goes_forward_and_back_through_every_layer_kind():
    """Depthwise-conv backward, grouped-conv forward, BatchNorm backward with running statistics and Flatten
    failed on a batch of 0 with IndexError or reshape errors."""
    def x():
        return Tensor(np.zeros((0, 4, 4, 4), np.float32), requires_grad=True)

    def one(*shape):
        return Tensor(np.ones(shape, np.float32), requires_grad=True)

    for groups, weight in ((4, one(4, 1, 3, 3)), (2, one(4, 2, 3, 3))):
        inp = x()
        ops.conv2d(inp, weight, groups=groups, padding=1).sum().backward()
        assert inp.grad.shape == (0, 4, 4, 4) and weight.grad.shape == weight.shape and not weight.grad.any()
    gamma, beta, inp = one(4), one(4), x()
    ops.batch_norm(inp, gamma, beta, np.zeros(4, np.float32), np.ones(4, np.float32), training=False).sum().backward()
    assert inp.grad.shape == (0, 4, 4, 4) and not gamma.grad.any() and not beta.grad.any()
    assert nn.Flatten()(x()).shape == (0, 64)


def test_integer_inputs_and_numpy_exponents_keep_the_float_dtype():
    """linear, matmul, conv2d, batch_norm, pow and integer division gave float64 (or a raw NumPy casting error),
    where add and mul already promote integers to the other operand's float dtype."""
    w = Tensor(np.ones((3, 4), np.float32), requires_grad=True)
    t = Tensor(np.full(3, 2.0, np.float32), requires_grad=True)
    assert ops.linear(np.ones((2, 4), np.int64), w).dtype == np.float32
    assert ops.matmul(np.ones((2, 3), np.int64), w).dtype == np.float32
    assert ops.conv2d(np.ones((1, 4, 4, 3), np.int64), Tensor(np.ones((2, 3, 3, 3), np.float32))).dtype == np.float32
    assert ops.conv2d(np.ones((1, 4, 4, 3), np.int64), Tensor(np.ones((3, 1, 3, 3), np.float32)),
                      groups=3).dtype == np.float32
    assert ops.batch_norm(np.ones((2, 3), np.int64), Tensor(np.ones(3, np.float32)), Tensor(np.zeros(3, np.float32)),
                          np.zeros(3, np.float32), np.ones(3, np.float32), training=False).dtype == np.float32
    assert (t ** np.float64(2)).dtype == np.float32 and (t ** np.arange(3)).dtype == np.float32
    np.testing.assert_allclose((t ** np.arange(3)).data, [1, 2, 4])
    assert (Tensor(np.full(3, 51, np.uint8)) / 255).dtype == np.float32
    roots = Tensor(np.array([4, 9])) ** 0.5
    assert roots.dtype == np.float32 and roots.data.tolist() == [2.0, 3.0]
    assert (Tensor(np.array([2, 3])) ** 2).dtype.kind == "i"  # integers squared stay integers


def test_float16_gradients_are_clipped_by_their_true_norm_and_adam_refuses_float16_parameters():
    from leaflens.engine.optim import clip_grad_norm_

    q = Parameter(np.zeros(3, np.float16))
    q.grad = np.array([300.0, 0, 0], np.float16)  # its square, 90000, is past float16's largest value
    assert float(clip_grad_norm_([q], 1.0)) == pytest.approx(300.0)
    np.testing.assert_allclose(q.grad.astype(np.float32), [1.0, 0, 0], rtol=1e-3)
    with pytest.raises(TypeError, match="float16 cannot hold them"):
        Adam([Parameter(np.ones(3, np.float16))], lr=1e-3)


def test_small_api_promises():
    from leaflens.engine.optim import WarmupCosine

    drop = nn.Dropout(0.5, rng=3)  # a seed: one generator, a new mask at every call
    x = Tensor(np.ones((1, 64), np.float32))
    assert not np.array_equal(drop(x).data, drop(x).data)

    p = Parameter(np.zeros(1, np.float32))
    sched = WarmupCosine(SGD([p], lr=1.0), total_steps=4, warmup_steps=4, min_factor=0.1)
    assert [round(sched.factor(n), 3) for n in range(6)] == [0.2, 0.4, 0.6, 0.8, 0.1, 0.1]

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight  # tied: listed twice by the two modules' parameters()
    opt = SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 3

    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    head = seq[:-1]
    assert isinstance(head, nn.Sequential) and len(head) == 2 and head[0] is seq[0]
    assert head(Tensor(np.ones((1, 2), np.float32))).shape == (1, 2)
    tail = seq[1:]
    assert sorted(tail.state_dict()) == ["2.bias", "2.weight"]  # the whole model's names: state dicts match
    tail.load_state_dict({k: v for k, v in seq.state_dict().items() if k.startswith("2.")})


def test_a_checkpoints_extra_takes_numpy_numbers_and_names_what_it_cannot_write(tmp_path):
    acc = (np.array([1, 0, 1]) == 1).sum()  # np.int64
    save_checkpoint(tmp_path / "c.npz", nn.Linear(2, 2), extra={"correct": acc, "lr": np.float32(0.5)})
    assert load_checkpoint(tmp_path / "c.npz", nn.Linear(2, 2)).extra == {"correct": 2, "lr": 0.5}
    with pytest.raises(TypeError, match=r"checkpoint extra\['when'\] cannot be written as JSON"):
        save_checkpoint(tmp_path / "d.npz", nn.Linear(2, 2), extra={"ok": 1, "when": object()})
    assert not (tmp_path / "d.npz").exists()
    with pytest.raises(TypeError, match=r"checkpoint extra cannot be written as JSON"):
        save_checkpoint(tmp_path / "d.npz", nn.Linear(2, 2), extra=[object()])


@pytest.mark.parametrize("dtype,x", [(np.float32, -20.0), (np.float32, -80.0), (np.float64, -40.0), (np.float64, 30.0)])
def test_sigmoid_keeps_its_relative_precision_far_from_zero(dtype, x):
    got = ops.sigmoid(Tensor(np.array([x], dtype))).data
    want = 1.0 / (1.0 + np.exp(-np.float64(x)))
    assert got.dtype == dtype
    np.testing.assert_allclose(got, [want], rtol=4 * np.finfo(dtype).eps)  # the tanh form gave 0 below about -17
    assert np.isfinite(np.log(got)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("pick", ["Max", "Min"])
def test_max_and_min_hand_back_gradients_in_the_input_dtype(dtype, pick):
    from leaflens.engine.ops import reduce

    fn = getattr(reduce, pick)(axis=1, keepdims=False)
    fn.forward(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 5.0]], dtype))
    g = fn.backward(np.ones(2, dtype))
    assert g.dtype == dtype  # was float64 (divided by an int64 count): all of backward upstream went float64
    np.testing.assert_array_equal(g, np.array([[0, 0.5, 0.5], [0, 0, 1]] if pick == "Max" else [[1, 0, 0], [0, 1, 0]],
                                              dtype))


def test_float16_l2_normalize_of_a_zero_row_is_zero_not_nan():
    x = Tensor(np.array([[0.0, 0.0, 0.0], [3.0, 4.0, 0.0]], np.float16))
    y = ops.l2_normalize(x, axis=1).data
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, np.array([[0, 0, 0], [0.6, 0.8, 0]], np.float16))
