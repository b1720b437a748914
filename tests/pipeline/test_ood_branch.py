"""The out-of-domain score's generic branch (pipeline/ood.py): the first blocks of a frozen pretrained
EfficientNet-Lite0 on the served model's input. Tiny random Lite0-shaped weights written as a PyTorch
checkpoint stand in for the ImageNet ones (no shared data, no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pth_checkpoint_files import TensorSpec, write_legacy
from test_efficientnet import tiny_state

from leaflens.apps.model_card import ModelCard, OODCheck
from leaflens.data_prep.contract import PreprocessContract
from leaflens.engine import Tensor, no_grad, ops
from leaflens.engine.nn import Module
from leaflens.pipeline import ood
from leaflens.pipeline.models import pretrained
from leaflens.pipeline.models.efficientnet import LiteConfig, normalize_images
from leaflens.pipeline.models.student import StudentCNN
from leaflens.pipeline.negatives import make_negatives

# Lite0's block layout with every width divided by 8 (seven stages, so the B0 strides are read from the shapes)
WIDTHS = [2, 3, 3, 5, 5, 10, 10, 10, 14, 14, 14, 24, 24, 24, 24, 40]
MEAN, STD = (0.45, 0.5, 0.4), (0.2, 0.25, 0.22)
SIZE = 16


@pytest.fixture(scope="module")
def lite0_file(tmp_path_factory) -> Path:
    """A legacy-format .pth of an EfficientNet-Lite0-shaped network with random weights."""
    blocks, cin = [], 4
    for i, c in enumerate(WIDTHS):
        blocks.append((cin, c, cin if i == 0 else 2 * cin, 3))
        cin = c
    state = tiny_state(seed=3, blocks=blocks, stem=4)
    path = tmp_path_factory.mktemp("lite0") / "tiny-lite0.pth"
    # (TensorSpec stores at least one dimension: the BatchNorm counters, scalars, are left out as the loader drops them)
    return write_legacy(path, {k: TensorSpec.of(str(i), v) for i, (k, v) in enumerate(state.items())
                               if not k.endswith("num_batches_tracked")})


def _student(seed: int = 0) -> StudentCNN:
    return StudentCNN(3, widths=(4, 8), rng=np.random.default_rng(seed)).eval()


def _photos(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 photos of three classes (a class colour with a texture of its own and noise), and labels."""
    rng = np.random.default_rng(seed)
    colours = np.array([(150, 90, 40), (40, 160, 50), (170, 60, 30)], np.float64)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    labels = np.arange(n) % 3
    out = []
    for c in labels:
        stripes = 40 * np.sin((xx if c % 2 else yy) / (2 + c) + rng.uniform(0, 6))[..., None]
        out.append(np.clip(colours[c] + stripes + rng.normal(0, 20, (SIZE, SIZE, 3)), 0, 255))
    return np.stack(out).astype(np.uint8), labels


def _normalised(images: np.ndarray) -> np.ndarray:
    return ((images.astype(np.float32) / 255 - np.float32(MEAN)) / np.float32(STD)).astype(np.float32)


def test_the_branch_sees_what_lite0_sees(lite0_file):
    branch, why = ood.generic_branch(MEAN, STD, blocks=5, weights=lite0_file)
    assert why is None and branch is not None and branch.num_blocks == 5
    # stem, then the ends of stages 1-3 among blocks 0-4 (blocks 0, 2, 4): as Lite0's own forward_blocks reads them
    assert branch.ends == [0, 2, 4]
    rec = branch.record()
    assert (rec.blocks, rec.maps, rec.weights) == (5, 4, "tiny-lite0.pth")
    assert rec.params == branch.num_parameters() > 0
    photos, _ = _photos(4, seed=1)
    net = pretrained.load_efficientnet_lite0(lite0_file, LiteConfig(padding="same", bn_eps=1e-3, normalization="tf"))
    with no_grad():
        maps = [m.numpy() for m in branch.maps(Tensor(_normalised(photos)))]
        # Lite0 on its own convention, (pixel - 127) / 128: the in-graph affine undid the model's normalisation
        x = Tensor(normalize_images(photos, "tf"))
        pre = net.stem_bn(net.stem_conv(x))
        h = net.run_blocks(ops.relu6(pre), 0, 5)
    np.testing.assert_allclose(maps[0], pre.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(maps[-1], h.numpy(), rtol=1e-4, atol=1e-4)
    assert [m.shape[-1] for m in maps] == [4, 2, 3, 5]
    with pytest.raises(ValueError, match="1 to 16"):
        ood.GenericBranch(net, 0, MEAN, STD, "x")


def test_fallback_to_the_models_own_blocks_when_the_weights_are_absent(tmp_path, monkeypatch):
    model = _student()
    scored, why = ood.with_generic_branch(model, MEAN, STD, weights=tmp_path / "missing.pth")
    assert scored is model and why is not None
    assert ood.METHOD_OWN in why and "missing.pth" in why
    # no weights given, none installed: the same, with the installer's hint
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name, *a: None)
    scored, why = ood.with_generic_branch(model, MEAN, STD)
    assert scored is model and "pip install" in str(why)
    photos, labels = _photos(30, seed=2)
    _, stats = ood.model_outputs(scored, _normalised(photos))
    _, check, _ = ood.fit_ood_head(stats, labels, stats, 3)
    assert check.method == ood.METHOD_OWN and check.branch is None and check.blocks == 2
    assert "branch" not in check.to_dict()  # a card without the branch is written as before it existed


def test_branch_statistics_and_score_engine_vs_onnx(lite0_file):
    ort = pytest.importorskip("onnxruntime")
    from leaflens.engine.onnx_export import convert_float16, export_onnx  # noqa: PLC0415

    scored, why = ood.with_generic_branch(_student(), MEAN, STD, weights=lite0_file)
    assert why is None and isinstance(scored, ood.WithGenericBranch)
    train, labels = _photos(60, seed=4)
    val, _ = _photos(30, seed=5)
    _, tr = ood.model_outputs(scored, _normalised(train))
    val_logits, va = ood.model_outputs(scored, _normalised(val))
    assert len(tr) == 2 + 4  # the student's two blocks, then the branch's four maps
    head, check, val_scores = ood.fit_ood_head(tr, labels, va, 3, branch=scored.branch.record())
    assert check.method == ood.METHOD and check.blocks == 6 and check.branch == scored.branch.record()

    # the branch's statistics alone, exported and run by onnxruntime
    class Stats(Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = scored

        def forward(self, x):
            _, maps = self.inner.forward_blocks(x)
            return tuple(ood.block_stats(m) for m in maps)

    x = _normalised(val)
    names = [f"s{i}" for i in range(6)]
    sess = ort.InferenceSession(export_onnx(Stats(), (3, SIZE, SIZE), output_name=names).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    for ours, theirs in zip(va, sess.run(None, {"input": x.transpose(0, 3, 1, 2)})):
        np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)

    served = ood.ServedModel(scored, head)
    proto = export_onnx(served, (3, SIZE, SIZE), output_name=("logits", ood.OOD_OUTPUT))
    assert sum(1 for n in proto.graph.node if n.op_type == "Conv") > 2 + 5  # the branch's convolutions are in it
    logits, score = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input": x.transpose(0, 3, 1, 2)})
    np.testing.assert_allclose(logits, val_logits, atol=1e-4)
    assert np.max(np.abs(score - val_scores) / np.maximum(1.0, np.abs(val_scores))) <= 1e-3
    s16 = ort.InferenceSession(convert_float16(proto).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        [ood.OOD_OUTPUT], {"input": x.transpose(0, 3, 1, 2)})[0]
    assert np.isfinite(s16).all()


def test_the_score_flags_generated_negatives_more_than_unseen_photos(lite0_file):
    """Fitted on training photos and thresholded on validation ones, the score (the student's blocks and the
    branch's) flags generated negatives (shuffled tiles, colour-permuted photos, blobs) far more often than
    in-domain photos it has never seen."""
    scored, _ = ood.with_generic_branch(_student(), MEAN, STD, weights=lite0_file)
    train, labels = _photos(90, seed=6)
    val, _ = _photos(60, seed=7)
    test, _ = _photos(60, seed=8)
    _, tr = ood.model_outputs(scored, _normalised(train))
    _, va = ood.model_outputs(scored, _normalised(val))
    head, check, _ = ood.fit_ood_head(tr, labels, va, 3, budget=0.05, branch=scored.branch.record())
    negatives = make_negatives(_normalised(test), 60, np.random.default_rng(0))
    _, te = ood.model_outputs(scored, _normalised(test))
    _, ne = ood.model_outputs(scored, negatives)
    flagged_test = float(np.mean(head.score_numpy(te) > check.threshold))
    flagged_neg = float(np.mean(head.score_numpy(ne) > check.threshold))
    assert flagged_test <= 0.15
    assert flagged_neg >= 0.6 and flagged_neg > flagged_test + 0.4
    # the branch's maps carry a signal of their own (even random convolutions see tiles and blobs differ)
    own = 2
    head, check, _ = ood.fit_ood_head(tr[own:], labels, va[own:], 3, budget=0.05)
    alone_test = float(np.mean(head.score_numpy(te[own:]) > check.threshold))
    alone_neg = float(np.mean(head.score_numpy(ne[own:]) > check.threshold))
    assert alone_neg >= 0.5 and alone_neg > alone_test + 0.3


def test_model_card_records_the_branch_and_reads_cards_without_it(lite0_file):
    branch, _ = ood.generic_branch(MEAN, STD, blocks=3, weights=lite0_file)
    assert branch is not None
    contract = PreprocessContract(stored_size=SIZE, input_size=SIZE, mean=MEAN, std=STD, resize="crop")
    new = OODCheck(method=ood.METHOD, threshold=3.0, budget=0.025, val_photos=40, val_flagged=0.025,
                   train_photos=100, blocks=6, branch=branch.record())
    card = ModelCard(classes=("a", "b"), contract=contract, uncertain_threshold=0.5, ood=new)
    back = ModelCard.from_metadata(card.to_metadata(), "new.onnx")
    assert back.ood == new and back.ood is not None and back.ood.branch is not None
    assert back.ood.branch.blocks == 3 and back.ood.branch.kind == "efficientnet-lite0-imagenet"
    # a file of the previous method, written before the branch existed, is read as it was
    old = OODCheck(method=ood.METHOD_OWN, threshold=3.0, budget=0.025, val_photos=40, val_flagged=0.025,
                   train_photos=100, blocks=2)
    meta = ModelCard(classes=("a", "b"), contract=contract, uncertain_threshold=0.5, ood=old).to_metadata()
    assert "branch" not in meta["leaflens.ood"]
    assert ModelCard.from_metadata(meta, "old.onnx").ood == old


def test_the_timing_stand_in_is_the_served_graph_with_placeholder_numbers(lite0_file):
    """distill times a candidate as it will be served (its out-of-domain score and the branch included: the demo
    student's time more than doubled) before any score is fitted: the stand-in's graph has the served graph's
    nodes and tensor shapes, only its numbers differ."""
    from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415

    scored, _ = ood.with_generic_branch(_student(), MEAN, STD, weights=lite0_file)
    train, labels = _photos(60, seed=4)
    val, _ = _photos(30, seed=5)
    _, tr = ood.model_outputs(scored, _normalised(train))
    _, va = ood.model_outputs(scored, _normalised(val))
    head, _, _ = ood.fit_ood_head(tr, labels, va, 3, branch=scored.branch.record())
    outputs = ("logits", ood.OOD_OUTPUT)

    def shape(model: Module) -> tuple[list[str], list[tuple[int, ...]]]:
        graph = export_onnx(model, (3, SIZE, SIZE), output_name=outputs).graph
        return [n.op_type for n in graph.node], sorted(tuple(t.dims) for t in graph.initializer)

    served = shape(ood.ServedModel(scored, head))
    assert shape(ood.timing_stand_in(_student(), SIZE, weights=lite0_file)) == served
    own_head, _, _ = ood.fit_ood_head(tr[:2], labels, va[:2], 3)  # the teacher's kind: its own blocks only
    own = shape(ood.ServedModel(_student(), own_head))
    assert shape(ood.timing_stand_in(_student(), SIZE, branch=False)) == own and len(own[0]) < len(served[0])
    plain = _Plain()
    assert ood.timing_stand_in(plain, SIZE) is plain  # no block outputs: it is served without a score


class _Plain(Module):
    """A model without forward_blocks."""

    def forward(self, x):
        return x.mean(axis=(1, 2))
