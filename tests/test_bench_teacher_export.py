"""benchmarks/near_ties.py and benchmarks/fp16_arith.py on an export that kept the TEACHER: it is served at its own
input size (here 32 px, decoded from the original photos with the shorter side at 36 px) while the dataset is
stored at 16 px. Both must give the model the photos as the Predictor serves them (as `leaflens export` scores a
teacher: pipeline/teachers/served.py's split_batches), not refuse it or feed it the 16 px arrays. A student's
export (stored at the dataset's size) is scored on the stored arrays, as before.

The models are tiny ONNX graphs with a leaflens model card (tests/apps/apps_helpers.py), so no training is needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_helpers import load_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent / "apps"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "data_prep"))

from apps_helpers import MEAN, STD, build_tiny_model, tiny_weights  # noqa: E402
from dp_helpers import make_class_folders  # noqa: E402

onnx = pytest.importorskip("onnx")

from leaflens.apps.model_card import ModelCard  # noqa: E402
from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.data_prep.contract import PreprocessContract, contract_for_dataset  # noqa: E402
from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset  # noqa: E402
from leaflens.engine.onnx_export import convert_float16  # noqa: E402

STORED = 16  # the dataset's size
TEACHER = PreprocessContract(stored_size=32, input_size=32, mean=tuple(MEAN), std=tuple(STD), resize="crop",
                             shorter_side=36)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("teacher_export")
    photos = make_class_folders(root / "photos", per_class=8)
    ingest(photos, root / "dataset", IngestOptions(size=STORED, ratios=(0.5, 0.25, 0.25)), workers=1,
           log=lambda s: None)
    return root / "dataset"


def export(folder: Path, ds_dir: Path, kind: str) -> Path:
    """``folder/student.onnx`` and ``student_fp16.onnx`` as `leaflens export` names them, whichever model it kept."""
    ds = load_dataset(ds_dir)
    contract = TEACHER if kind == "teacher" else contract_for_dataset(ds, STORED)
    card = ModelCard(classes=tuple(ds.classes), contract=contract)
    folder.mkdir()
    fp32 = build_tiny_model(folder / "student.onnx", tiny_weights(ds.num_classes), contract.input_size,
                            card.to_metadata())
    onnx.save(convert_float16(onnx.load(str(fp32))), str(folder / "student_fp16.onnx"))
    return folder


def served_accuracy(model: Path, ds_dir: Path) -> float:
    """The validation accuracy of ``model`` on the original photo files, decoded by the Predictor (as served)."""
    ds = load_dataset(ds_dir)
    predictor = Predictor(model, intra_op_threads=1)
    photos = np.stack([predictor.decode(Path(ds.manifest.source_root) / f, refuse=False) for f in ds["val"].files])
    return float(np.mean(predictor.predict_arrays(photos).argmax(1) == np.asarray(ds["val"].labels)))


@pytest.mark.parametrize("kind", ["teacher", "student"])
def test_near_ties_scores_the_photos_as_the_model_is_served(dataset, tmp_path, capsys, kind):
    model = export(tmp_path / "export", dataset, kind) / "student.onnx"
    bench = load_benchmark("near_ties.py")
    assert bench.main(["--model", str(model), "--dataset", str(dataset)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["photos"] == len(load_dataset(dataset)["val"])
    assert out["accuracy"] == round(served_accuracy(model, dataset), 4)


@pytest.mark.parametrize("kind", ["teacher", "student"])
def test_fp16_arith_runs_on_the_photos_at_the_models_stored_size(dataset, tmp_path, capsys, kind):
    folder = export(tmp_path / "export", dataset, kind)
    load_benchmark("fp16_arith.py").main(["--export", str(folder), "--dataset", str(dataset), "--photos", "4"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["photos"] == 4 and out["top1_agreement"] == 1.0 and out["max_logit_diff"] < 0.05
