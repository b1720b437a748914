"""Security basics: no pickle loads of user files, bounded uploads, loopback by default, no path escapes.

The pickle rule is checked on the syntax tree of every product and benchmark source file (so a
call split over lines is still seen), and the checker is itself tested on code that breaks each
rule, so the test can fail. The live-server checks (address actually bound, Gradio's file route
refusing paths outside its allowed folders, Gradio's own upload size limit) are ``slow``.
"""

from __future__ import annotations

import argparse
import ast
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rel_helpers import REPO, class_folders, cli_env, tiny_model

PRODUCT = ("engine", "kernels", "data_prep", "pipeline", "apps")
# The one place a pickle is unpickled: PyTorch checkpoints, through a find_class that admits only tensor
# rebuilding (pipeline/models/torch_weights.py). Benchmarks may call torch.load(weights_only=True) as a reference.
RESTRICTED_UNPICKLER = ("pipeline/models/torch_weights.py", "_RestrictedUnpickler")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "marshal", "shelve", "cloudpickle"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def pickle_findings(source: str, rel: str, strict_np_load: bool) -> list[str]:
    """Every way ``source`` could unpickle data: unsafe loaders, np.load without allow_pickle=False,
    allow_pickle=True anywhere, Unpickler subclasses other than the restricted one."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, tail = name.rpartition(".")
            kw = {k.arg: k.value for k in node.keywords}
            pickled = kw.get("allow_pickle")
            if isinstance(pickled, ast.Constant) and pickled.value is True:
                found.append(f"{where}: allow_pickle=True in {name}()")
            if head.split(".")[-1] in UNSAFE_MODULES and tail in ("load", "loads", "Unpickler", "open"):
                found.append(f"{where}: {name}()")
            if name in ("torch.load",):
                wo = kw.get("weights_only")
                if strict_np_load or not (isinstance(wo, ast.Constant) and wo.value is True):
                    found.append(f"{where}: torch.load() in product code or without weights_only=True")
            if name in ("np.load", "numpy.load") and strict_np_load:
                if not (isinstance(pickled, ast.Constant) and pickled.value is False):
                    found.append(f"{where}: {name}() without an explicit allow_pickle=False")
            if name in ("yaml.load", "yaml.unsafe_load"):
                found.append(f"{where}: {name}()")
        if isinstance(node, ast.ClassDef):
            bases = {_dotted(b) for b in node.bases}
            if bases & {"pickle.Unpickler", "Unpickler", "_pickle.Unpickler"}:
                if (rel, node.name) != RESTRICTED_UNPICKLER:
                    found.append(f"{where}: Unpickler subclass {node.name}")
                elif not any(isinstance(b, ast.FunctionDef) and b.name == "find_class" for b in node.body):
                    found.append(f"{where}: {node.name} does not restrict find_class")
    return found


def _sources():
    for top in (*PRODUCT, "benchmarks"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            yield rel, path.read_text(encoding="utf-8"), top != "benchmarks"


def test_no_pickle_loads_of_user_files():
    files, findings = 0, []
    for rel, text, strict in _sources():
        files += 1
        findings += pickle_findings(text, rel, strict)
    assert files > 50
    assert not findings, "\n".join(findings)


def test_the_pickle_checker_catches_each_rule():
    bad = {
        "import pickle\npickle.load(open('x', 'rb'))\n": "pickle.load",
        "import pickle as p\nimport numpy as np\nnp.load('x.npy')\n": "allow_pickle",
        "import numpy as np\nnp.load(\n    'x.npz',\n    allow_pickle=True,\n)\n": "allow_pickle=True",
        "import joblib\njoblib.load('m.pkl')\n": "joblib.load",
        "import torch\ntorch.load('w.pth')\n": "torch.load",
        "import pickle\nclass U(pickle.Unpickler):\n    pass\n": "Unpickler subclass",
        "import yaml\nyaml.load(open('c.yml'))\n": "yaml.load",
    }
    for code, what in bad.items():
        hits = pickle_findings(code, "pipeline/x.py", True)
        assert any(what in h for h in hits), (code, hits)
    ok = "import numpy as np\nnp.load('x.npy', mmap_mode='r', allow_pickle=False)\n"
    assert pickle_findings(ok, "pipeline/x.py", True) == []


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pth_file_is_refused_and_runs_nothing(tmp_path):
    from leaflens.pipeline.models.torch_weights import load_torch_state_dict

    marker = tmp_path / "pwned"
    evil = tmp_path / "weights.pth"
    evil.write_bytes(pickle.dumps({"conv.weight": _Payload(marker)}, protocol=2))
    with pytest.raises(Exception) as exc:  # noqa: B017 - the type is the reader's; the point is: no code ran
        load_torch_state_dict(evil)
    assert str(evil) in str(exc.value) or "system" in str(exc.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------- uploads
@pytest.fixture
def service(tmp_path):
    pytest.importorskip("onnxruntime")
    from leaflens.apps.predictor import Predictor
    from leaflens.apps.service import DiagnosisService, ServiceOptions

    svc = DiagnosisService(Predictor(tiny_model(tmp_path / "m.onnx"), intra_op_threads=1),
                           options=ServiceOptions(max_upload_mb=0.05, decode_workers=1))
    yield svc
    svc.close()


def test_uploads_limited_in_size_and_type(service, tmp_path, monkeypatch):
    from rel_helpers import encode, photo

    decoded = []
    real = service.predictor.decode
    monkeypatch.setattr(service.predictor, "decode", lambda p: (decoded.append(Path(p).name), real(p))[1])
    files = {
        "big.png": encode(photo(1, (90, 140, 60), 200, 200), "PNG"),  # > 0.05 MB
        "ok.jpg": encode(photo(2, (90, 140, 60)), "JPEG"),
        "notes.jpg": b"just text with an image extension\n" * 20,
        "page.html": b"<html><script>alert(1)</script></html>",
        "phone.heic": b"\x00\x00\x00\x18ftypheic" + b"\x00" * 100,
    }
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    assert (tmp_path / "big.png").stat().st_size > service.max_upload_bytes
    result = service.diagnose(paths)
    by_name = {p["name"]: p for p in result["photos"]}
    assert by_name["ok.jpg"]["ok"]
    assert by_name["big.png"]["error"]["reason"] == "file_too_big" and "big.png" not in decoded  # never decoded
    assert by_name["notes.jpg"]["error"]["reason"] == "not_an_image"
    assert by_name["page.html"]["error"]["reason"] == "not_an_image"
    assert by_name["phone.heic"]["error"]["reason"] in ("heic_unsupported", "corrupt", "not_an_image")
    # more photos than allowed in one request: only max_photos are read
    many = service.diagnose([paths[1]] * (service.options.max_photos + 5))
    assert len(many["photos"]) == service.options.max_photos and many["given"] == service.options.max_photos + 5


# ---------------------------------------------------------------------------- binding
def test_server_binds_loopback_unless_told():
    from leaflens.apps import cmd_serve

    parser = argparse.ArgumentParser()
    cmd_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.share is False
    # leaflens.apps.web.launch's own defaults, read from its source (importing Gradio costs seconds)
    tree = ast.parse((REPO / "apps" / "web.py").read_text(encoding="utf-8"))
    launch = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "launch")
    args_ = launch.args.args[-len(launch.args.defaults):]
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(args_, launch.args.defaults)}
    assert defaults["host"] == "127.0.0.1" and defaults["share"] is False
    call = next(n for n in ast.walk(launch) if isinstance(n, ast.Call) and _dotted(n.func).endswith(".launch"))
    kw = {k.arg: _dotted(k.value) for k in call.keywords}
    assert kw["server_name"] == "host" and kw["share"] == "share"  # passed through, not hard-wired


# ---------------------------------------------------------------------------- paths
def test_triton_model_name_cannot_escape_the_repository():
    from leaflens.pipeline.export.triton import TritonConfigError, check_model_name

    for bad in ("..", ".", ".hidden", "../x", "a/b", "a\\b", "/abs", "", "x\n"):
        with pytest.raises(TritonConfigError):
            check_model_name(bad)
    for good in ("leaflens_student", "model-2", "v1.0"):
        check_model_name(good)


def test_dataset_file_list_cannot_send_the_teacher_outside_the_photos(tmp_path, capsys):
    """The teacher re-reads photos as <source_root>/<line of files.txt>: a list edited to point
    elsewhere (../../etc/passwd) is refused by its checksum before anything is read."""
    from leaflens.data_prep.ingest import IngestOptions, ingest
    from leaflens.pipeline.cli import main as cli

    ds = ingest(class_folders(tmp_path / "photos", per_class=6), tmp_path / "ds", IngestOptions(size=16),
                workers=1, log=lambda *_: None).out
    files = ds / "train_files.txt"
    lines = files.read_text().splitlines()
    lines[0] = "../../../../../../etc/passwd"
    files.write_text("\n".join(lines) + "\n")
    assert cli(["teacher", "--dataset", str(ds), "--out", str(tmp_path / "t"), "--onnx", str(tmp_path / "x.onnx"),
                "--quiet"]) == 1
    err = capsys.readouterr().err
    assert str(files) in err and "altered" in err


# ---------------------------------------------------------------------------- the live server (slow)
def _listening(port: int) -> list[str]:
    """Local addresses with a listening TCP socket on ``port`` (IPv4 and IPv6, from /proc/net)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                out.append(addr)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_live_server_loopback_file_route_and_upload_limit(tmp_path):
    pytest.importorskip("gradio")
    import urllib.error
    import urllib.request

    model = tiny_model(tmp_path / "m.onnx")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the web")
    port = _free_port()
    uploads = tmp_path / "uploads"
    cmd = [sys.executable, "-m", "leaflens", "serve", "--model", str(model), "--port", str(port),
           "--no-examples", "--max-upload-mb", "0.05", "--uploads-dir", str(uploads)]
    # the server gives Gradio its upload folder in place of the one a user's environment names
    env = cli_env() | {"GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_TEMP_DIR": str(tmp_path / "gradio")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _listening(port):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        addrs = _listening(port)
        assert addrs == ["0100007F"], f"listening on {addrs}, expected only 127.0.0.1"
        base = f"http://127.0.0.1:{port}"
        for target in (str(secret), "/etc/passwd", str(model), f"{uploads}/../secret.txt"):
            for route in ("/gradio_api/file=", "/file="):
                try:
                    with urllib.request.urlopen(base + route + target, timeout=10) as r:
                        body = r.read()
                    assert b"not for the web" not in body and b"root:" not in body, (route, target)
                except urllib.error.HTTPError as exc:
                    assert exc.code in (403, 404), (route, target, exc.code)
        import httpx  # a Gradio dependency
        from gradio_client import Client, handle_file
        from rel_helpers import encode, photo

        from leaflens.apps.web_assets import UPLOAD_CAP_FACTOR

        cap = UPLOAD_CAP_FACTOR * 0.05 * 1024 * 1024  # Gradio's own limit (the app answers files up to it)
        big = encode(photo(1, (90, 140, 60), 200, 200), "PNG")
        assert 0.05 * 1024 * 1024 < len(big) < cap
        huge = b"\x89PNG\r\n\x1a\n" + os.urandom(int(cap) + 1024)
        # the raw upload route (what any script can call): the size limit holds on the server
        r = httpx.post(base + "/gradio_api/upload", files={"files": ("huge.png", huge, "image/png")}, timeout=30)
        assert r.status_code == 413, (r.status_code, r.text[:200])
        # an uploaded file name cannot climb out of the server's upload folder
        small = encode(photo(2, (90, 140, 60)), "JPEG")
        r = httpx.post(base + "/gradio_api/upload", files={"files": ("../../../evil.jpg", small, "image/jpeg")},
                       timeout=30)
        assert r.status_code == 200, r.text[:200]
        stored = Path(r.json()[0]).resolve()
        assert uploads.resolve() in stored.parents and not (tmp_path / "evil.jpg").exists()
        assert not (tmp_path / "gradio").exists()
        # the API end to end: a good photo is answered, one over the app's limit is refused in the app's words,
        # and the client refuses one over Gradio's before sending it
        (tmp_path / "big.png").write_bytes(big)
        (tmp_path / "huge.png").write_bytes(huge)
        (tmp_path / "ok.jpg").write_bytes(small)
        client = Client(base + "/", verbose=False)
        answer = client.predict([handle_file(str(tmp_path / "ok.jpg")), handle_file(str(tmp_path / "big.png"))],
                                api_name="/diagnose")
        ok, too_big = answer["photos"]
        assert ok["ok"] and too_big["error"]["reason"] == "file_too_big", answer
        with pytest.raises(Exception, match="maximum file size"):
            client.predict([handle_file(str(tmp_path / "huge.png"))], api_name="/diagnose")
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
