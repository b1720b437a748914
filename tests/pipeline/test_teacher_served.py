"""The fine-tuned teacher as a servable model: teacher.onnx, kept by distill when it wins within the budget,
shipped by export.

The photos are made so that only the teacher can tell the classes apart: horizontal stripes, vertical stripes
and a checkerboard, 4 px on and 4 px off, on 128 px photos with a random colour. Stored at 16 px (8x8 blocks:
one whole period each), every class is the same flat colour, so the students are at chance; the teacher
decodes the original photos at 64 px (shorter side 73) and sees the stripes. A detail the small input loses
is what makes the teacher worth shipping on pest photos, too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pretrained = pytest.importorskip("leaflens.pipeline.models.pretrained")

from leaflens.apps.model_card import TIE_RATIO, ModelCard, unsure  # noqa: E402
from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.data_prep.contract import ContractError, PreprocessContract  # noqa: E402
from leaflens.data_prep.decode import decode_image_at  # noqa: E402
from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset  # noqa: E402
from leaflens.engine import Tensor, no_grad  # noqa: E402
from leaflens.pipeline import calibration  # noqa: E402
from leaflens.pipeline import distill as distill_stage  # noqa: E402
from leaflens.pipeline.cli import main as cli  # noqa: E402
from leaflens.pipeline.runs import TEACHER_MODEL, read_run  # noqa: E402
from leaflens.pipeline.teachers import served  # noqa: E402
from leaflens.pipeline.teachers.artefact import load_teacher  # noqa: E402
from leaflens.pipeline.teachers.stage import iter_split_images  # noqa: E402

CLASSES = ("checks", "horizontal", "vertical")
# The module's 9 validation photos are too few to fit a temperature (calibration.MIN_PHOTOS): a fixed one
# shows where the fitted one goes (teacher.onnx, distill's teacher candidate, the export of a kept teacher).
TEMPERATURE = 0.5
SIZE = 64  # the teacher's input
FAST = ["--set", "train.epochs=2", "--set", "train.min_steps=0", "--set", "model.widths=[8]", "--quiet"]


def _stripes(root: Path, per_class: int = 20) -> Path:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:128, 0:128]
    for kind in CLASSES:
        (root / kind).mkdir(parents=True)
        for i in range(per_class):
            py, px = rng.integers(0, 8, 2)
            h, v = ((y + py) // 4) % 2, ((x + px) // 4) % 2
            m = {"horizontal": h, "vertical": v, "checks": h ^ v}[kind]
            img = rng.integers(60, 200, 3)[None, None] + (2 * m[..., None] - 1) * 50 + rng.normal(0, 5, (128, 128, 3))
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / kind / f"{kind}_{i:02d}.png")
    return root


@pytest.fixture(scope="module")
def fixed_temperature():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "fit_temperature", lambda logits, labels: TEMPERATURE)
        yield TEMPERATURE


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, fixed_temperature):
    try:
        pretrained.find_lite0_weights()
    except pretrained.WeightsNotFoundError as exc:
        pytest.skip(f"EfficientNet-Lite0 weights not installed: {exc}")
    tmp = tmp_path_factory.mktemp("served")
    ingest(_stripes(tmp / "photos"), tmp / "dataset", IngestOptions(size=16), workers=1, log=lambda s: None)
    assert cli(["teacher", "--dataset", str(tmp / "dataset"), "--out", str(tmp / "t"), "--input-size", str(SIZE),
                "--epochs", "4", "--set", "teacher.batch_size=8", "--set", "teacher.min_steps=0",
                # the cached last-blocks fine-tune: the default trains every block, 4x the CPU, for nothing here
                "--set", "teacher.augment=cached", "--set", "teacher.finetune_from_block=14", "--quiet"]) == 0
    return tmp


@pytest.fixture(scope="module")
def kept_run(teacher):
    """A distill run with the default budget: the teacher wins on validation and is kept."""
    tmp = teacher
    assert cli(["distill", "--dataset", str(tmp / "dataset"), "--teacher", str(tmp / "t"), "--out",
                str(tmp / "run"), *FAST]) == 0
    return tmp / "run", json.loads((tmp / "run" / "report.json").read_text())


def test_the_teacher_stage_writes_a_servable_teacher(teacher):
    ds = load_dataset(teacher / "dataset")
    tt = load_teacher(teacher / "t", ds)
    info = served.read_served(tt.info.stage, "teacher.json")
    assert info is not None and info.written, info
    assert (teacher / "t" / served.MODEL_FILE).is_file() and (teacher / "t" / served.ONNX_FILE).is_file()
    assert info.contract == PreprocessContract(stored_size=SIZE, input_size=SIZE, mean=(127 / 255,) * 3,
                                               std=(128 / 255,) * 3, resize="crop", shorter_side=73)
    assert info.parity["max_abs_diff"] <= 1e-4 and info.parity["ood_max_rel_diff"] <= 1e-3
    assert info.val_accuracy is not None and info.val_accuracy > 0.8  # the stripes are plain to see at 64 px
    assert info.temperature == TEMPERATURE  # teacher.onnx serves calibrated probabilities, as a student does


def test_teacher_onnx_decodes_photos_as_the_teacher_stage_and_matches_the_engine(teacher):
    ds = load_dataset(teacher / "dataset")
    pred = Predictor(teacher / "t" / served.ONNX_FILE, intra_op_threads=1)
    assert pred.has_ood and pred.card.contract.shorter_side == 73 and pred.card.params > 3_000_000
    # its "ambiguous" share counts near ties as the app serves them (it counted the threshold alone)
    assert pred.card.tie_ratio == TIE_RATIO and pred.card.val_ambiguous is not None
    files = [Path(ds.manifest.source_root) / f for f in ds["val"].files]
    stage_pixels = np.concatenate(list(iter_split_images(ds, "val", SIZE, 73, batch=32)))
    pixels = np.stack([pred.decode(f, refuse=False) for f in files])
    np.testing.assert_array_equal(pixels, stage_pixels)  # the very pixels the teacher was fine-tuned on
    np.testing.assert_array_equal(pixels[0], decode_image_at(files[0], SIZE, "crop", shorter_side=73))
    net, meta = served.load_teacher_model(teacher / "t" / served.MODEL_FILE)
    assert meta.contract == pred.card.contract and list(meta.classes) == list(ds.classes)
    scores = pred.score_arrays(pixels)
    with no_grad():
        logits, _ = net.forward_blocks(Tensor(pred.card.contract.prepare(pixels)))
    # model.npz keeps the network as trained; teacher.onnx divides its logits by the validation temperature
    assert pred.card.temperature == TEMPERATURE
    z = logits.numpy() / TEMPERATURE
    np.testing.assert_allclose(np.log(scores["probs"]), z - np.log(np.exp(z).sum(1, keepdims=True)), atol=1e-4)
    assert np.isfinite(scores["ood_score"]).all()
    # the card's "ambiguous" share is the served rule's on these photos: the threshold and near ties together
    assert pred.card.val_ambiguous == pytest.approx(
        float(np.mean(unsure(scores["probs"], pred.card.uncertain_threshold))), abs=1e-6)
    answers = [pred.judge(row).top[0][0] for row in scores]
    assert np.mean([a == ds.classes[y] for a, y in zip(answers, ds["val"].labels)]) > 0.8


def test_distill_keeps_the_teacher_that_wins_within_the_budget(kept_run):
    run, report = kept_run
    sel = report["selection"]
    rows = {c["name"]: c for c in sel["candidates"]}
    assert set(rows) == {"distilled", "scratch", "teacher"}
    for c in rows.values():
        assert c["params"] > 0 and c["ms_per_photo"] > 0 and c["val_accuracy"] is not None and c["why"]
    assert rows["teacher"]["val_accuracy"] >= max(rows["distilled"]["val_accuracy"],
                                                  rows["scratch"]["val_accuracy"]) + 0.02
    assert sel["kept"] == report["winner"] == "teacher" and rows["teacher"]["kept"]
    assert rows["teacher"]["ms_per_photo"] > rows["scratch"]["ms_per_photo"]  # 3.4 M parameters vs 259
    assert report["params"] == rows["teacher"]["params"] and report["val_accuracy"] == rows["teacher"]["val_accuracy"]
    info = read_run(run)
    assert info.kept == "teacher" and (run / TEACHER_MODEL).is_file()
    assert info.kept_metrics is not None and info.kept_metrics.val_accuracy == rows["teacher"]["val_accuracy"]
    md = (run / "report.md").read_text()
    assert "## Kept model" in md and "| teacher |" in md and "**kept**" in md
    # the kept teacher's probabilities are calibrated as a student's: the threshold chosen on them, the export told
    assert info.kept_metrics.temperature == TEMPERATURE and report["calibration"]["temperature"] == TEMPERATURE
    assert report["calibration"]["test_ece_uncalibrated"] is not None
    assert f"calibrated on validation (logits / {TEMPERATURE:.3f})" in md


def test_the_teacher_is_not_kept_over_max_params(teacher):
    out = teacher / "run_small"
    assert cli(["distill", "--dataset", str(teacher / "dataset"), "--teacher", str(teacher / "t"), "--out", str(out),
                "--max-params", "1000000", *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = {c["name"]: c for c in report["selection"]["candidates"]}
    assert report["winner"] in ("distilled", "scratch") and not rows["teacher"]["within_budget"]
    assert "max_params 1,000,000" in rows["teacher"]["why"]
    assert read_run(out).kept is None and not (out / TEACHER_MODEL).exists()


def test_a_teacher_whose_network_cannot_be_read_is_said_on_the_console(teacher, tmp_path, capsys):
    """A truncated model.npz made the teacher no candidate with one line in report.md only: distill exited 0 and
    shipped a worse student without a word on the console."""
    import shutil  # noqa: PLC0415

    damaged = tmp_path / "t"
    shutil.copytree(teacher / "t", damaged)
    data = (damaged / served.MODEL_FILE).read_bytes()
    (damaged / served.MODEL_FILE).write_bytes(data[:len(data) // 2])
    capsys.readouterr()
    assert cli(["distill", "--dataset", str(teacher / "dataset"), "--teacher", str(damaged), "--out",
                str(tmp_path / "run"), *[a for a in FAST if a != "--quiet"]]) == 0
    err = capsys.readouterr().err
    assert "warning: the teacher is no candidate for the kept model: " in err and served.MODEL_FILE in err
    assert "run `leaflens teacher` again to make it one" in err


def test_the_teacher_is_not_kept_over_max_ms(teacher, monkeypatch):
    """Latency is measured on the machine; here it is fixed (the students 1 ms, the teacher 40 ms) so the
    budget's effect does not depend on the machine's load."""
    monkeypatch.setattr(distill_stage, "measure_ms", lambda model, size, threads, **_: (
        40.0 if model.num_parameters() > 10**6 else 1.0, "fixed"))
    out = teacher / "run_fast"
    assert cli(["distill", "--dataset", str(teacher / "dataset"), "--teacher", str(teacher / "t"), "--out", str(out),
                "--max-ms", "10", *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = {c["name"]: c for c in report["selection"]["candidates"]}
    assert report["winner"] != "teacher" and not rows["teacher"]["within_budget"]
    assert "40.00 ms per photo > max_ms 10" in rows["teacher"]["why"] and rows["scratch"]["within_budget"]


def test_export_of_a_teacher_kept_run_serves_the_teacher(kept_run, teacher):
    run, report = kept_run
    out = teacher / "export"
    assert cli(["export", "--run", str(run), "--dataset", str(teacher / "dataset"), "--out", str(out),
                "--calib-images", "16", "--speed-seconds", "0.1"]) == 0
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] and parity["model"]["kind"] == "teacher"
    assert parity["served"]["checked"] and abs(parity["served"]["difference_points"]) <= 0.5
    assert parity["int8"]["written"] or parity["int8"]["reason"]
    pred = Predictor(out / "student.onnx", intra_op_threads=1)
    card: ModelCard = pred.card
    assert card.contract.shorter_side == 73 and card.input_size == SIZE and card.run_id == report["run_id"]
    assert card.params == report["params"] and pred.has_ood
    assert card.temperature == TEMPERATURE  # folded into the teacher's classifier, as for a student
    ds = load_dataset(teacher / "dataset")
    net, meta = served.load_teacher_model(run / TEACHER_MODEL)
    pixels = np.stack([pred.decode(Path(ds.manifest.source_root) / f, refuse=False) for f in ds["val"].files[:4]])
    with no_grad():
        z = net(Tensor(meta.contract.prepare(pixels))).numpy() / TEMPERATURE
    np.testing.assert_allclose(np.log(pred.score_arrays(pixels)["probs"]),
                               z - np.log(np.exp(z).sum(1, keepdims=True)), atol=1e-4)
    files = [str(Path(ds.manifest.source_root) / f) for f in ds["test"].files]
    answers = pred.predict_files(files, refuse=False)
    assert np.mean([a.top[0][0] == ds.classes[y] for a, y in zip(answers, ds["test"].labels)]) > 0.8
    triton_model = out / "triton" / "leaflens_student" / "1" / "model.onnx"
    assert triton_model.read_bytes() == (out / "student.onnx").read_bytes()


def test_a_teacher_seen_through_upsampled_arrays_is_not_servable(teacher):
    ds = load_dataset(teacher / "dataset")
    with pytest.raises(served.TeacherNotServable, match="--from-arrays"):
        served.teacher_contract(ds, SIZE, from_arrays=True)
    # at the stored size the stage used the stored pixels: decoded straight to that size
    assert served.teacher_contract(ds, 16, from_arrays=True).shorter_side is None


def test_contract_shorter_side_is_checked_and_carried_by_the_model_card():
    c = PreprocessContract(stored_size=224, input_size=224, mean=(0.5,) * 3, std=(0.5,) * 3, shorter_side=256)
    assert PreprocessContract.from_dict(c.to_dict()) == c
    assert "shorter_side" not in PreprocessContract(stored_size=8, input_size=8, mean=(0.5,) * 3,
                                                    std=(0.5,) * 3).to_dict()  # students write what they did
    for kw, why in (({"shorter_side": 100}, ">= stored_size"), ({"shorter_side": 256, "resize": "pad"}, "'crop' only")):
        with pytest.raises(ContractError, match=why):
            PreprocessContract(stored_size=224, input_size=224, mean=(0.5,) * 3, std=(0.5,) * 3, **kw)
    card = ModelCard(classes=("a", "b"), contract=c)
    meta = card.to_metadata()
    assert meta["leaflens.shorter_side"] == "256"
    assert ModelCard.from_metadata(meta, "m.onnx") == card
    del meta["leaflens.shorter_side"]  # a student's (or an older) file: decoded straight to the stored size
    assert ModelCard.from_metadata(meta, "m.onnx").contract.shorter_side is None


def test_distill_says_why_a_teacher_without_a_served_model_is_no_candidate(tmp_path):
    from pipeline_helpers import class_features, tiny_dataset  # noqa: PLC0415

    from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher  # noqa: PLC0415

    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp_path / "feats"), ds)
    write_teacher(tmp_path / "t", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size), progress=False)
    assert cli(["distill", "--dataset", str(ds_dir), "--teacher", str(tmp_path / "t"), "--out", str(tmp_path / "r"),
                "--set", "train.epochs=1", "--set", "train.min_steps=0", "--set", "model.widths=[4]", "--quiet"]) == 0
    sel = json.loads((tmp_path / "r" / "report.json").read_text())["selection"]
    assert [c["name"] for c in sel["candidates"]] == ["distilled", "scratch"]
    # not "run leaflens teacher again": that can never make a features file a candidate
    assert "is a features file: only the fine-tuned EfficientNet teacher" in sel["teacher_unavailable"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "The teacher was not a candidate" in md
    assert "- Teacher: kind features-file, file `feats`, sha256 " not in md  # this teacher recorded no digest
    assert "- Teacher: kind features-file, file `feats`" in md  # which file taught, not only its kind


def test_a_teacher_onnx_that_cannot_be_made_leaves_the_features_and_says_why(tmp_path, monkeypatch):
    """The features are the teacher stage's product: a failure to export teacher.onnx is recorded, not fatal."""
    from pipeline_helpers import tiny_dataset  # noqa: PLC0415

    from leaflens.engine import onnx_export  # noqa: PLC0415

    try:
        pretrained.find_lite0_weights()
    except pretrained.WeightsNotFoundError as exc:
        pytest.skip(f"EfficientNet-Lite0 weights not installed: {exc}")
    real = onnx_export.export_onnx

    def refuse_served(model, *args, **kwargs):
        if isinstance(model, served.ood.ServedModel):
            raise onnx_export.ExportError("no converter for this test")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx_export, "export_onnx", refuse_served)
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--epochs", "1", "--input-size",
                "32", "--set", "teacher.min_steps=0", "--quiet"]) == 0
    tt = load_teacher(tmp_path / "t", load_dataset(ds_dir))
    info = served.read_served(tt.info.stage, "teacher.json")
    assert info is not None and not info.written and "ExportError: no converter for this test" in info.reason
    assert (tmp_path / "t" / served.MODEL_FILE).is_file() and not (tmp_path / "t" / served.ONNX_FILE).exists()
    net, meta = served.load_teacher_model(tmp_path / "t" / served.MODEL_FILE)  # the network is kept all the same
    assert meta.contract is not None and meta.contract.shorter_side == 37 and net.num_classes == 3


def test_the_teacher_stage_says_its_probabilities_are_calibrated(teacher):
    from leaflens.pipeline.cli.teacher import summary_text  # noqa: PLC0415

    ds = load_dataset(teacher / "dataset")
    info = served.read_served(load_teacher(teacher / "t", ds).info.stage, "teacher.json")
    assert info is not None
    text = summary_text({"teacher": {"kind": "efficientnet-lite0"}, "served": info.to_dict()}, teacher / "t")
    assert f"probabilities calibrated on validation (logits / {TEMPERATURE:.3f})" in text
    plain = summary_text({"teacher": {}, "served": {**info.to_dict(), "temperature": None}}, teacher / "t")
    assert "calibrated" not in plain and "served as teacher.onnx" in plain  # a teacher made before calibration


def test_teacher_onnx_parity_allows_rounding_in_proportion_to_the_logits(monkeypatch):
    """Calibrated logits are the network's divided by a temperature (down to 0.25: 4x larger), and float32
    rounding grows with them: the teacher stage's gate is relative to the largest logit, as the export's is."""
    from leaflens.pipeline.export import parity  # noqa: PLC0415

    engine = np.array([[12.0, -3.0, 1.0], [-8.0, 9.5, 0.5]], np.float32)
    for shift, fails in ((5e-4, False), (5e-3, True)):  # 12 x 1e-4 allowed
        outputs = ({"engine": engine, "fp32": engine + np.float32(shift)},
                   {"engine": np.zeros(2), "fp32": np.zeros(2)})
        monkeypatch.setattr(parity, "engine_and_onnx_outputs", lambda *a, out=outputs, **k: out)
        contract = PreprocessContract(stored_size=8, input_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)
        figures, failures = served.check_against_engine(None, None, np.zeros((2, 8, 8, 3), np.uint8), contract)
        assert bool(failures) is fails, failures
        assert not fails or "x the largest |logit|" in failures[0]
