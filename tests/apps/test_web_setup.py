"""How `leaflens serve` finds its context: run report, dataset examples, class notes, model tab; CLI errors."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from apps_helpers import fake_run, make_dataset, serve_args

from leaflens.apps.examples import write_examples
from leaflens.apps.model_info import ServeContext, discover, model_markdown, run_images
from leaflens.data_prep.decode import decode_image
from leaflens.data_prep.manifest import load_dataset

CLASSES = ["early_blight", "healthy", "rust"]  # sorted: the order preprocess gives


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return make_dataset(tmp_path, CLASSES)


def test_examples_reproduce_the_dataset_pixels(dataset, tmp_path):
    paths = write_examples(dataset, tmp_path / "cache", CLASSES)
    assert sorted(p.stem for p in paths) == CLASSES
    ds = load_dataset(dataset)
    labels = np.asarray(ds["test"].labels)
    for p in paths:
        row = int(np.flatnonzero(labels == CLASSES.index(p.stem))[0])
        assert decode_image(p, 16).tolist() == np.asarray(ds["test"].images[row]).tolist()
        assert min(decode_image(p, 16).shape[:2]) == 16
    again = write_examples(dataset, tmp_path / "cache", CLASSES)  # reused, not rewritten
    assert again == paths and all(p.stat().st_mtime_ns == q.stat().st_mtime_ns for p, q in zip(paths, again))
    assert write_examples(dataset, tmp_path / "cache2", ["a", "b", "c"]) == []  # another model's classes
    assert write_examples(tmp_path / "nothing", tmp_path / "cache3", CLASSES) == []


def test_discover_follows_the_export_records(dataset, tmp_path, tiny_model):
    from leaflens.apps.predictor import Predictor

    run = fake_run(tmp_path, dataset)
    export = tmp_path / "export"
    export.mkdir()
    model, _ = tiny_model(classes=CLASSES, name="student.onnx", **{"leaflens.run_id": "r1"})
    model = model.replace(export / "student.onnx")
    (export / "parity.json").write_text(json.dumps({"run": {"path": str(run / "best.npz")},
                                                    "dataset": {"root": str(dataset)}}))
    ctx = discover(model)
    assert ctx.run_dir == run and ctx.dataset_root == dataset and ctx.run_report["params"] == 1234
    assert ctx.notes_path == dataset / "classes.toml" and ctx.warnings == []
    assert set(run_images(ctx)) == {"confusion", "curves"}
    # a run that kept its teacher: curves.png is its students' training, not the served model's
    teacher_kept = ServeContext(run_dir=run, run_report={**ctx.run_report, "winner": "teacher"})
    assert set(run_images(teacher_kept)) == {"confusion"}
    teacher_md = model_markdown(Predictor(model), teacher_kept, "en")
    assert "`student.onnx` (the fine-tuned teacher, EfficientNet-Lite0" in teacher_md
    md = model_markdown(Predictor(model), ctx, "en")
    assert "fine-tuned teacher" not in md  # a student run's file is the student
    assert "90.0% (95% confidence interval 80.0% to 95.0%, 60 test photos)" in md
    assert "16 x 16" in md and "CPUExecutionProvider" in md and "`r1`" in md and "1,234" in md
    assert "(default, not calibrated)" in md
    assert "no out-of-domain check" in md and "leaflens export" in md  # a model without one says so
    assert "置信区间" in model_markdown(Predictor(model), ctx, "zh")

    # explicit arguments win; a missing explicit path is an error naming it; no records -> warnings only
    other = tmp_path / "notes.json"
    other.write_text("{}")
    assert discover(model, notes_path=other).notes_path == other
    with pytest.raises(FileNotFoundError, match="--run .*nowhere"):
        discover(model, run_dir=tmp_path / "nowhere")
    bare, _ = tiny_model(classes=CLASSES, name="bare.onnx")
    ctx = discover(bare)
    assert ctx.run_dir is None and ctx.run_report is None and ctx.dataset_root is None
    assert "No training report" in model_markdown(Predictor(bare), ctx, "en")


def test_relative_records_of_an_older_export_are_found_from_any_working_folder(tmp_path, tiny_model, monkeypatch):
    """Exports once recorded the run and dataset as given (``artifacts/student``), relative to wherever the export
    ran: served from another folder, they are found above the model's folder; a record of nothing is a warning."""
    project = tmp_path / "project"
    run = fake_run(project / "artifacts", make_dataset(project / "artifacts", CLASSES, 16))
    export = project / "artifacts" / "export"
    export.mkdir()
    model, _ = tiny_model(classes=CLASSES)
    model = model.replace(export / "student.onnx")
    rel_run = run.relative_to(project)
    (export / "parity.json").write_text(json.dumps({"run": {"path": str(rel_run / "best.npz")},
                                                    "dataset": {"root": "artifacts/dataset"}}))
    monkeypatch.chdir(tmp_path)  # not the project folder the export ran in
    ctx = discover(model)
    assert ctx.run_dir == project / rel_run and ctx.warnings == []
    assert ctx.dataset_root == project / "artifacts" / "dataset"
    (export / "parity.json").write_text(json.dumps({"run": {"path": "artifacts/elsewhere/best.npz"}}))
    ctx = discover(model)
    assert ctx.run_dir is None and ctx.warnings == [f"{export / 'parity.json'} names run folder artifacts/elsewhere, "
                                                    "which is gone"]


def test_a_moved_project_is_found_again_by_the_run_id_and_the_manifest_hash(tmp_path, tiny_model):
    """parity.json records absolute paths: after the project folder is moved or renamed, the run and the
    dataset are looked up above the model's folder by their last parts, and taken only when they are the
    recorded run (report.json's run_id) and dataset (manifest.json's SHA-256)."""
    import hashlib
    import shutil

    old = tmp_path / "old" / "project" / "artifacts"
    dataset = make_dataset(old, CLASSES, 16)
    run = fake_run(old, dataset)
    report = json.loads((run / "report.json").read_text())
    (run / "report.json").write_text(json.dumps({**report, "run_id": "r7"}))
    export = old / "export"
    export.mkdir()
    model, _ = tiny_model(classes=CLASSES)
    model = model.replace(export / "student.onnx")
    sha = hashlib.sha256((dataset / "manifest.json").read_bytes()).hexdigest()
    (export / "parity.json").write_text(json.dumps({"run": {"id": "r7", "path": str(run / "best.npz")},
                                                    "dataset": {"root": str(dataset), "manifest_sha256": sha}}))
    new = tmp_path / "new home"
    shutil.move(tmp_path / "old", new)
    artifacts = new / "project" / "artifacts"
    ctx = discover(artifacts / "export" / "student.onnx")
    assert ctx.run_dir == artifacts / "student" and ctx.dataset_root == artifacts / "dataset"
    assert ctx.warnings == [] and ctx.run_report["run_id"] == "r7"

    # another run and another dataset in their places are not taken for the recorded ones
    (artifacts / "student" / "report.json").write_text(json.dumps({**report, "run_id": "r8"}))
    manifest = artifacts / "dataset" / "manifest.json"
    manifest.write_text(manifest.read_text() + " ")
    ctx = discover(artifacts / "export" / "student.onnx")
    assert ctx.run_dir is None and ctx.dataset_root is None
    assert ctx.warnings == [f"{artifacts / 'export' / 'parity.json'} names run folder {run}, which is gone"]

    # the recorded folder itself, trained again since the export: its figures are not this model's
    (artifacts / "export" / "parity.json").write_text(json.dumps({"run": {"id": "r7", "path": str(
        artifacts / "student" / "best.npz")}, "dataset": {"root": str(artifacts / "dataset"), "manifest_sha256": sha}}))
    ctx = discover(artifacts / "export" / "student.onnx")
    assert ctx.run_dir is None and ctx.run_report is None and ctx.dataset_root is None
    assert "now holds another run (trained again since this export)" in ctx.warnings[0]

    # one student of that run (`export --run RUN/scratch`): not "trained again", but not the run's kept model
    (artifacts / "student" / "report.json").write_text(json.dumps({**report, "run_id": "r7"}))
    (artifacts / "student" / "scratch").mkdir()
    (artifacts / "export" / "parity.json").write_text(json.dumps({"run": {"id": "r7", "path": str(
        artifacts / "student" / "scratch" / "best.npz")}, "dataset": {"root": str(artifacts / "dataset")}}))
    ctx = discover(artifacts / "export" / "student.onnx")
    assert ctx.run_dir is None and ctx.run_report is None
    assert ctx.warnings == [f"{artifacts / 'export' / 'parity.json'} names {artifacts / 'student' / 'scratch'}, one "
                            f"student (scratch) of the run in {artifacts / 'student'}: that run's figures and plots "
                            "are those of the model it kept, so none are shown for this one"]


def test_model_tab_says_how_the_thresholds_were_chosen_and_what_they_cost(tiny_model):
    from leaflens.apps.model_info import ServeContext
    from leaflens.apps.predictor import Predictor

    model, _ = tiny_model(classes=CLASSES, ood_threshold=-0.125,
                          **{"leaflens.uncertain_threshold": "0.62", "leaflens.val_ambiguous": "0.085",
                             "leaflens.ood": json.dumps({"method": "block-mahalanobis-1", "threshold": 7.25,
                                                         "budget": 0.03, "val_photos": 1200, "val_flagged": 0.0275,
                                                         "train_photos": 4800, "blocks": 4})})
    predictor = Predictor(model)
    assert predictor.card.ood.threshold == 7.25  # the metadata above, not the helper's default
    md = model_markdown(predictor, ServeContext(), "en")
    line = next(row for row in md.splitlines() if row.startswith("- **Out-of-domain check:**"))
    for figure in ("7.25", "`block-mahalanobis-1`", "4,800 training photos", "1,200 validation photos",
                   "at most 3.0%", "it flags 2.8%"):
        assert figure in line, (figure, line)
    line = next(row for row in md.splitlines() if row.startswith("- **Unsure between two classes:**"))
    assert "below 0.62" in line and "validation photos by `leaflens distill`" in line
    # a model exported before near ties counted: its figure is the threshold's alone, and the tab says so
    assert "8.5% of the validation photos fall below the threshold (measured before near ties" in line
    assert "default" not in line
    newer, _ = tiny_model(name="newer.onnx", classes=CLASSES, **{"leaflens.uncertain_threshold": "0.62",
                                                                 "leaflens.val_ambiguous": "0.101",
                                                                 "leaflens.tie_ratio": "0.9"})
    line = next(row for row in model_markdown(Predictor(newer), ServeContext(), "en").splitlines()
                if row.startswith("- **Unsure between two classes:**"))
    assert "10.1% of the validation photos get this answer" in line
    zh = model_markdown(predictor, ServeContext(), "zh")
    assert "域外检查" in zh and "1,200 张验证集照片" in zh and "8.5%" in zh
    assert "EfficientNet" not in md and "EfficientNet" not in zh  # a score of the model's own blocks only


def test_model_tab_names_the_generic_branch_of_the_out_of_domain_score(tiny_model):
    from leaflens.apps.model_info import ServeContext
    from leaflens.apps.predictor import Predictor

    branch = {"kind": "efficientnet-lite0-imagenet", "blocks": 5, "maps": 4, "params": 55504,
              "weights": "efficientnet-lite0-57934424.pth"}
    model, _ = tiny_model(classes=CLASSES, name="branch.onnx", ood_threshold=19.1,
                          **{"leaflens.ood": json.dumps({"method": "block-mahalanobis-2", "threshold": 19.1,
                                                         "budget": 0.025, "val_photos": 133, "val_flagged": 0.0226,
                                                         "train_photos": 1034, "blocks": 8, "branch": branch})})
    predictor = Predictor(model)
    assert predictor.card.ood.branch is not None and predictor.card.ood.branch.blocks == 5
    md = model_markdown(predictor, ServeContext(), "en")
    line = next(row for row in md.splitlines() if row.startswith("- **Out-of-domain check:**"))
    assert "`block-mahalanobis-2`" in line and "first 5 blocks of an ImageNet-pretrained EfficientNet-Lite0" in line
    assert "前 5 个模块" in model_markdown(predictor, ServeContext(), "zh")


def test_cli_defaults_are_local_and_private():
    import argparse  # noqa: PLC0415

    from leaflens.apps import cmd_serve  # noqa: PLC0415

    args = cmd_serve.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args([])
    assert args.host == "127.0.0.1" and args.share is False and args.port == 7860
    assert args.model == "artifacts/export/student.onnx" and args.max_upload_mb == 20.0


def test_cli_errors_exit_2_with_a_message(tmp_path, capsys, tiny_model):
    from leaflens.apps import cmd_serve

    assert cmd_serve.run(serve_args(model=tmp_path / "missing.onnx")) == 2
    assert "missing.onnx: model file not found (`leaflens export` writes one" in capsys.readouterr().err
    model, _ = tiny_model()
    assert cmd_serve.run(serve_args(model=model, port=0)) == 2
    assert "--port must be 1..65535" in capsys.readouterr().err
    assert cmd_serve.run(serve_args(model=model, port=-1)) == 2  # was read as a bad --host
    assert "--port must be 1..65535, got -1" in capsys.readouterr().err
    assert cmd_serve.run(serve_args(model=model, classes_notes=tmp_path / "nope.toml")) == 2
    assert "--classes-notes" in capsys.readouterr().err
    bad = tmp_path / "classes.toml"
    bad.write_text("[classes.x\n")
    assert cmd_serve.run(serve_args(model=model, classes_notes=bad)) == 2
    assert "not valid TOML" in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    ({"max_upload_mb": float("nan")}, "--max-upload-mb must be a finite number"),
    ({"max_upload_mb": float("inf")}, "--max-upload-mb must be a finite number"),
    ({"max_wait_ms": float("nan")}, "--max-wait-ms must be a finite number"),
    ({"corrections_max_mb": float("inf")}, "--corrections-max-mb must be a finite number"),
    ({"corrections_max_mb": 1e-7}, "--corrections-max-mb must be at least 0.001 (a kilobyte)"),
    ({"corrections": ""}, "--corrections is empty"),
    ({"uploads_dir": " "}, "--uploads-dir is empty"),
    ({"corrections": "/proc/leaflens_corrections"}, "cannot be created or written"),
    ({"corrections": "FILE/sub"}, "cannot be created or written"),
    ({"corrections": "C", "uploads_dir": "C/uploads"}, "overlap"),
])
def test_serve_options_that_cannot_work_are_refused_before_any_work(tmp_path, capsys, tiny_model, flags, words,
                                                                    monkeypatch):
    from leaflens.apps import cmd_serve

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("leaflens.apps.web.launch", lambda *a, **k: pytest.fail("the server was started"))
    (tmp_path / "FILE").write_text("a file, not a folder")
    model, _ = tiny_model()
    assert cmd_serve.run(serve_args(model=model, no_examples=True, port=7989, **flags)) == 2
    assert words in capsys.readouterr().err
    assert not list(tmp_path.glob("C*")) and not any(Path(tempfile.gettempdir()).glob("leaflens-uploads-7989*"))


def test_a_corrections_folder_the_server_did_not_start_is_refused(tmp_path, capsys, tiny_model, monkeypatch):
    """`--corrections <the training photos>` saved corrections straight into the source classes, past the rules
    `preprocess --also` keeps for them."""
    from leaflens.apps import cmd_serve
    from leaflens.apps.corrections import LOCK_NAME, LOG_NAME

    monkeypatch.setattr("leaflens.apps.web.launch", lambda *a, **k: pytest.fail("the server was started"))
    model, _ = tiny_model()
    photos = tmp_path / "photos"
    (photos / "healthy").mkdir(parents=True)
    (photos / "healthy" / "leaf.jpg").write_bytes(b"x")
    assert cmd_serve.run(serve_args(model=model, no_examples=True, corrections=photos)) == 2
    assert f"--corrections {photos}: not empty and not a corrections folder (no {LOG_NAME} in it)" in \
        capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    failed_first = tmp_path / "failed_first"  # a first save that failed (disk full): its class folder and lock only
    (failed_first / "healthy").mkdir(parents=True)
    (failed_first / LOCK_NAME).write_bytes(b"")
    (photos / LOG_NAME).write_text("")  # a folder a server started: its log beside its class folders
    for ours in (tmp_path / "new", tmp_path / "empty", failed_first, photos):
        cmd_serve._check_corrections_folder(serve_args(model=model, corrections=ours))


def test_the_address_is_checked_before_the_server_starts():
    import socket

    from leaflens.apps.cmd_serve import UsageError, check_listen

    assert check_listen("127.0.0.1", 0) is True and check_listen("127.0.0.2", 0) is True  # loopback: no warning
    assert check_listen("0.0.0.0", 0) is False
    with pytest.raises(UsageError, match="IPv6"):
        check_listen("::1", 0)
    with pytest.raises(UsageError, match="not an address or name"):
        check_listen("999.1.1.1", 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(UsageError, match=f"--port {taken.getsockname()[1]}: already in use"):
            check_listen("127.0.0.1", taken.getsockname()[1])
    for held_by in ("0.0.0.0", "127.0.0.1"):  # a server on every address holds the loopback port too
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the web server binds
            taken.bind((held_by, 0))
            taken.listen()
            with pytest.raises(UsageError, match="already in use"):
                check_listen("127.0.0.1", taken.getsockname()[1])


@pytest.mark.skipif(sys.platform == "win32", reason="TIME_WAIT and SO_REUSEADDR as on Linux and macOS")
def test_a_port_whose_last_server_just_stopped_is_free_again():
    """A restart right after a stop was refused for about a minute ("already in use") while the stopped server's
    connections were closing, though nothing listened and the web server itself would have bound."""
    import socket

    from leaflens.apps.cmd_serve import check_listen

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    server.close()
    client.close()
    assert check_listen("127.0.0.1", port) is True
