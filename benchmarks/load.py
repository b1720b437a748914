"""Load on the web app and on the DynamicBatcher: N concurrent clients for a bounded time, on 127.0.0.1.

Phases (each client is a thread in a closed loop: send one photo, wait for its answer, repeat):

1. ``batcher``: ``DynamicBatcher(Predictor.predict_arrays)`` driven directly with decoded photos,
   queue bound as the app's service has it (256): every answer is checked against the photo's
   own batch-1 probabilities (a batching bug that mixed rows would count as failed);
2. ``batcher overload``: the same with a queue smaller than the number of clients, to show that
   "busy" rejections start exactly past the queue size, and that nothing is lost even then;
3. ``app``: `leaflens serve` started as a subprocess on 127.0.0.1 (or ``--url`` of a running one),
   driven through its public API endpoint ``/diagnose`` with ``gradio_client`` (file upload, queue,
   JSON answer), one Client per thread; answers are checked against a local Predictor's. gradio_client
   opens a new HTTP client for each of its four requests per call, and each loads the system's TLS
   certificates even for a plain http:// URL: 0.17 s of client CPU per call, 69 % of this process's CPU,
   which made the clients, not the app, the bottleneck (p50 3.5 s at 32 clients on 2 cores, Little's law:
   32 clients / 9 answers per second). The Clients here share one TLS context (``ssl_verify`` takes an
   ``ssl.SSLContext`` as httpx's ``verify`` does), which a script calling the app many times should do too;
4. ``app_http``: the same endpoint through Gradio's plain HTTP API (upload, call, event stream), as
   a curl script would call it: lighter still on the client, so this phase loads the server itself
   (``server_p50_ms`` is the time inside the app, from its answer);
5. ``app_overload`` (``--overload``): a server whose Gradio queue is smaller than the clients.

Every phase first runs the same load for a warm-up (not counted) so that the memory baseline is
taken once thread pools and allocator arenas have their working size.

Counted per phase: ``sent`` requests, ``answered`` (correct answer), ``busy`` (rejected as busy:
queue full), ``failed`` (an error or a wrong answer), ``lost`` (no answer within the request
timeout, or never settled); p50/p99 latency of the answered ones; RSS of the serving process
before (after a warm-up) and after the run, sampled every second in between (``rss_growth_mb``
= after - before, ``rss_slope_second_half_mb_per_min``: the trend once caches have filled); the
app's upload folder, sampled with it (``upload_files_max``, ``upload_mb_max``: it must stay bounded,
uploads being deleted once answered, leaflens.apps.uploads); CPU seconds per answer of the server
process and of this one, the clients (``server_cpu_ms_per_answer``, ``client_cpu_ms_per_answer``:
where the time goes on a machine whose cores they share), and the load average around the phase.

Targets: 0 lost and 0 failed at 32 clients; busy only past the queue size; memory slope <= 1 MB/min;
the upload folder bounded.

    nice -n 19 python benchmarks/load.py [--clients 32] [--seconds 30] [--model student.onnx] [--overload]
                                         [--keep-uploads-minutes N]

Without ``--model`` a stand-in of the student's shape (4 conv blocks 32-64-128-256, 64x64 input, 8
classes, random weights) is built. The last line of output is one JSON object: the app's figures
(keys sent, answered, busy, failed, lost, p50_ms, p99_ms, rss_growth_mb) with each phase nested, and
the app's headline figures under their own keys: ``app_p50_ms`` and ``app_answers_per_s`` (phase
``app``, through gradio_client), ``app_http_p50_ms`` and ``app_http_answers_per_s``,
``app_rss_slope_mb_per_min`` and ``app_upload_files_max`` / ``app_upload_mb_max`` (the worst of the
app phases), ``loadavg``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from leaflens.apps.batcher import BatcherBusy, DynamicBatcher
from leaflens.apps.model_card import ModelError
from leaflens.apps.predictor import Predictor

REPO = Path(__file__).resolve().parents[1]

REQUEST_TIMEOUT_S = 60.0  # an answer later than this counts as lost


# ---------------------------------------------------------------------------- inputs
def build_standin(path: Path, size: int = 64, widths: tuple[int, ...] = (32, 64, 128, 256), classes: int = 8,
                  seed: int = 0) -> Path:
    """An ONNX model of the student's shape with leaflens metadata (conv3x3+ReLU+maxpool blocks, GAP, Gemm)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, prev, cin = [], [], "input", 3
    for i, w in enumerate(widths):
        inits += [numpy_helper.from_array(rng.normal(0, np.sqrt(2 / (9 * cin)), (w, cin, 3, 3)).astype(np.float32),
                                          f"w{i}"), numpy_helper.from_array(np.zeros(w, np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                  helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2])]
        prev, cin = f"p{i}", w
    inits += [numpy_helper.from_array(rng.normal(0, 0.3, (classes, cin)).astype(np.float32), "fc_w"),
              numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b")]
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
              helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "standin_student", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {
        "leaflens.format": "1", "leaflens.classes": json.dumps([f"class_{i}" for i in range(classes)]),
        "leaflens.input_size": str(size), "leaflens.mean": "[0.5, 0.5, 0.5]", "leaflens.std": "[0.25, 0.25, 0.25]",
        "leaflens.layout": "NCHW", "leaflens.resize": "crop"})
    onnx.save(model, str(path))
    return path


def make_photos(folder: Path, count: int, size: tuple[int, int] = (1024, 768)) -> list[Path]:
    """``count`` distinct phone-like JPEGs (gradient, ellipses, blur, sensor noise)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(count):
        rng = np.random.default_rng(k)
        w, h = size
        small = Image.new("RGB", (w // 8, h // 8), (40 + 10 * k % 200, 110, 60))
        draw = ImageDraw.Draw(small)
        for _ in range(25):
            x, y, r = rng.integers(0, w // 8), rng.integers(0, h // 8), rng.integers(3, 30)
            draw.ellipse([x - r, y - r // 2, x + r, y + r // 2], fill=tuple(int(v) for v in rng.integers(20, 230, 3)))
        big = np.asarray(small.resize(size, Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2)), np.int16)
        noisy = np.clip(big + rng.normal(0, 5, big.shape), 0, 255).astype(np.uint8)
        path = folder / f"leaf_{k:02d}.jpg"
        Image.fromarray(noisy).save(path, quality=88)
        out.append(path)
    return out


# ---------------------------------------------------------------------------- accounting
@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    busy: int = 0
    failed: int = 0
    lost: int = 0
    # array('d'): 8 bytes per answer, so the batcher phase's RSS (this process) is not the benchmark's own
    # record growing (a list of floats costs 32 bytes per answer, 4.5 MB over 140 000 answers)
    latencies_ms: array = field(default_factory=lambda: array("d"))
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, ms: float | None = None, error: str | None = None) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            if ms is not None:
                self.latencies_ms.append(ms)
            if error:
                self.errors[error[:160]] += 1

    def summary(self, seconds: float) -> dict:
        lat = np.frombuffer(self.latencies_ms, np.float64) if len(self.latencies_ms) else np.zeros(1)
        return {"sent": self.sent, "answered": self.answered, "busy": self.busy, "failed": self.failed,
                "lost": self.lost, "p50_ms": round(float(np.percentile(lat, 50)), 2),
                "p99_ms": round(float(np.percentile(lat, 99)), 2),
                "answered_per_s": round(self.answered / seconds, 1) if seconds else 0.0,
                "errors": dict(self.errors.most_common(5))}


def warmup_s(seconds: float) -> float:
    """Load applied before the memory baseline is taken (thread pools, arenas, caches reach their size)."""
    return min(10.0, max(2.0, seconds / 5))


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all its threads (None: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def folder_usage(folder: Path | None) -> tuple[int, int] | None:
    """(files, bytes) under ``folder``, marker files left out (None: no folder to look at)."""
    if folder is None:
        return None
    files = bytes_ = 0
    for q in folder.rglob("*"):
        try:
            if q.is_file() and not q.name.startswith("."):
                files, bytes_ = files + 1, bytes_ + q.stat().st_size
        except OSError:  # deleted while counted
            continue
    return files, bytes_


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """RSS of ``pid`` once a second while the load runs, and the files in ``folder`` (the app's uploads)."""

    def __init__(self, pid: int, folder: Path | None = None):
        super().__init__(daemon=True)
        self.pid, self.samples, self._stop_event = pid, [], threading.Event()
        self.folder, self.folder_samples = folder, []

    def run(self) -> None:
        while not self._stop_event.wait(1.0):
            value = rss_mb(self.pid)
            if value is not None:
                self.samples.append(value)
            usage = folder_usage(self.folder)
            if usage is not None:
                self.folder_samples.append(usage)

    def stop(self) -> list[float]:
        self._stop_event.set()
        self.join()
        return self.samples


def _rss_fields(before: float | None, after: float | None, samples: list[float]) -> dict:
    if before is None or after is None:
        return {"rss_before_mb": None, "rss_after_mb": None, "rss_max_mb": None, "rss_growth_mb": None}
    half = samples[len(samples) // 2:]
    slope = float(np.polyfit(np.arange(len(half)), half, 1)[0]) * 60 if len(half) >= 4 else None
    trace = [round(samples[i], 1) for i in np.linspace(0, len(samples) - 1, min(len(samples), 12)).astype(int)]
    return {"rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_max_mb": round(max(samples + [after]), 1), "rss_growth_mb": round(after - before, 1),
            "rss_slope_second_half_mb_per_min": None if slope is None else round(slope, 2),
            "rss_trace_mb": trace}


def _run_clients(clients: int, seconds: float, worker, setup=None) -> float:
    """Start ``clients`` threads running ``worker(i, state, stop)`` until ``seconds`` pass; the wall time."""
    stop = threading.Event()
    states = [setup(i) if setup else None for i in range(clients)]
    threads = [threading.Thread(target=worker, args=(i, states[i], stop), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- batcher
def batcher_phase(predictor: Predictor, photos: list[np.ndarray], clients: int, seconds: float,
                  max_queue: int) -> dict:
    expected = [predictor.predict_arrays(p[None])[0] for p in photos]
    batcher = DynamicBatcher(predictor.predict_arrays, max_batch_size=32, max_wait_ms=2.0, max_queue=max_queue,
                             timeout_s=REQUEST_TIMEOUT_S / 2, name="load-bench")
    box = {"tally": Tally()}

    def worker(i: int, _state, stop: threading.Event) -> None:
        k = i
        tally = box["tally"]
        while not stop.is_set():
            k = (k + 1) % len(photos)
            with tally.lock:
                tally.sent += 1
            t0 = time.perf_counter()
            try:
                fut = batcher.submit(photos[k])
            except BatcherBusy:
                tally.add("busy")
                time.sleep(0.002)  # a client backs off a little before retrying
                continue
            except Exception as exc:  # noqa: BLE001
                tally.add("failed", error=f"{type(exc).__name__}: {exc}")
                continue
            try:
                probs = fut.result(timeout=REQUEST_TIMEOUT_S)
            except FutureTimeout:
                tally.add("lost" if not fut.done() else "failed", error="no answer in time")
                continue
            except Exception as exc:  # noqa: BLE001 - timed out in the batcher, closed, model error
                tally.add("failed", error=f"{type(exc).__name__}: {exc}")
                continue
            ms = (time.perf_counter() - t0) * 1000.0
            if not np.allclose(probs, expected[k], atol=1e-5):
                tally.add("failed", error="wrong answer (rows mixed up?)")
            else:
                tally.add("answered", ms)

    _run_clients(clients, warmup_s(seconds), worker)  # warm-up under the same load, not counted
    box["tally"] = tally = Tally()
    before = rss_mb(os.getpid())
    sampler = RssSampler(os.getpid())
    sampler.start()
    wall = _run_clients(clients, seconds, worker)
    batcher.close(drain=True, timeout_s=30)
    stats = batcher.stats()
    after = rss_mb(os.getpid())
    warm_stats_answered = stats.answered - tally.answered
    out = tally.summary(wall)
    out.update(_rss_fields(before, after, sampler.stop()))
    out.update({"clients": clients, "max_queue": max_queue, "seconds": round(wall, 1),
                "batcher_stats": stats.as_dict()})
    out["warmup_answered"] = warm_stats_answered
    # the batcher's own account: every request it accepted was settled (nothing pending after close)
    out["lost"] += stats.pending
    return out


# ---------------------------------------------------------------------------- app
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_knows(flag: str) -> bool:
    """Whether this `leaflens serve` has ``flag`` (the benchmark also measures older versions)."""
    out = subprocess.run([sys.executable, "-m", "leaflens", "serve", "--help"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    return flag in out.stdout


def start_server(model: Path, port: int, gradio_tmp: Path, queue_size: int | None, log: Path,
                 keep_uploads_minutes: float | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "leaflens", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--no-examples", "--no-corrections"]  # nothing of the run in the repo's artifacts/
    if queue_size is not None:
        cmd += ["--queue-size", str(queue_size)]
    if serve_knows("--uploads-dir"):  # its own upload folder, swept (older versions: Gradio's, via the variable)
        cmd += ["--uploads-dir", str(gradio_tmp)]
        if keep_uploads_minutes is not None:
            cmd += ["--keep-uploads-minutes", str(keep_uploads_minutes)]
    env = dict(os.environ, GRADIO_TEMP_DIR=str(gradio_tmp), GRADIO_ANALYTICS_ENABLED="False")
    fh = open(log, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    proc._log_fh = fh  # type: ignore[attr-defined]
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    proc._log_fh.close()  # type: ignore[attr-defined]


def wait_ready(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float = 180.0) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:] if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


class HttpApi:
    """The app's /diagnose endpoint through Gradio's plain HTTP API (upload, call, event stream): what a
    curl script does, and much lighter on the client than gradio_client, so the server gets the load."""

    class Busy(Exception):
        pass

    def __init__(self, url: str):
        import httpx

        self.base = url.rstrip("/")
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def diagnose(self, name: str, data: bytes) -> dict:
        r = self.http.post(self.base + "/gradio_api/upload", files={"files": (name, data, "image/jpeg")})
        r.raise_for_status()
        payload = {"data": [[{"path": r.json()[0], "meta": {"_type": "gradio.FileData"}}]]}
        r = self.http.post(self.base + "/gradio_api/call/diagnose", json=payload)
        if r.status_code == 503:  # Gradio's queue is full
            raise HttpApi.Busy(r.text[:160])
        r.raise_for_status()
        event = None
        with self.http.stream("GET", f"{self.base}/gradio_api/call/diagnose/{r.json()['event_id']}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    body = line[5:].strip()
                    if event == "error":
                        raise RuntimeError(f"error event: {body[:160]}")
                    return json.loads(body)[0]
        raise RuntimeError("the event stream ended without a result")

    def close(self) -> None:
        self.http.close()


def app_phase(url: str, server_pid: int | None, photos: list[Path], local: Predictor, clients: int,
              seconds: float, gradio_tmp: Path | None, mode: str = "gradio_client") -> dict:
    from gradio_client import Client, handle_file

    try:
        from gradio_client.utils import QueueError
    except ImportError:  # pragma: no cover - other gradio_client versions
        QueueError = RuntimeError  # noqa: N806

    expected = {}
    for p in photos:
        pred = local.predict_image(p)
        # the app names no class for an out-of-domain photo: expect what it shows
        shown = pred.verdict != "out_of_domain"
        expected[p.name] = (pred.label if shown else None, pred.confidence if shown else None)
    handles = [handle_file(str(p)) for p in photos]
    blobs = [p.read_bytes() for p in photos]
    # one TLS context for every request of every Client: gradio_client would otherwise load the system's
    # certificates for each of its requests (0.17 s of CPU per call), plain http:// included
    tls = ssl.create_default_context()

    def setup(i: int):
        return Client(url, verbose=False, ssl_verify=tls) if mode == "gradio_client" else HttpApi(url)  # type: ignore[arg-type]


    def call(api, k: int) -> dict:
        if mode == "gradio_client":
            return api.submit([handles[k]], api_name="/diagnose").result(timeout=REQUEST_TIMEOUT_S)
        return api.diagnose(photos[k].name, blobs[k])

    box = {"tally": Tally(), "server_ms": []}

    def worker(i: int, api, stop: threading.Event) -> None:
        k = i
        tally, server_ms = box["tally"], box["server_ms"]
        while not stop.is_set():
            k = (k + 1) % len(photos)
            with tally.lock:
                tally.sent += 1
            t0 = time.perf_counter()
            try:
                answer = call(api, k)
            except FutureTimeout:
                tally.add("lost", error="no answer within the request timeout")
                continue
            except (QueueError, HttpApi.Busy) as exc:
                tally.add("busy", error=f"{type(exc).__name__}: {exc}")
                time.sleep(0.01)
                continue
            except Exception as exc:  # noqa: BLE001 - network errors, error events, timeouts of httpx
                name = type(exc).__name__
                tally.add("lost" if "Timeout" in name else "failed", error=f"{name}: {exc}")
                continue
            ms = (time.perf_counter() - t0) * 1000.0
            photo = (answer or {}).get("photos", [{}])[0]
            if photo.get("ok"):
                label, conf = expected[photos[k].name]
                same_conf = conf is None if photo["confidence"] is None else (
                    conf is not None and abs(photo["confidence"] - conf) < 1e-4)
                if photo["label"] == label and same_conf:
                    tally.add("answered", ms)
                    with tally.lock:
                        server_ms.append(float(answer.get("server_ms", float("nan"))))
                else:
                    tally.add("failed", error=f"wrong answer {photo['label']} {photo['confidence']}")
            elif (photo.get("error") or {}).get("reason") == "busy":
                tally.add("busy", error="service busy")
            else:
                tally.add("failed", error=json.dumps(photo.get("error"))[:160])

    apis = [setup(i) for i in range(clients)]
    _run_clients(clients, warmup_s(seconds), worker, apis.__getitem__)  # warm-up under load, not counted
    box["tally"], box["server_ms"] = tally, server_ms = Tally(), []
    time.sleep(1.0)
    before = rss_mb(server_pid) if server_pid else None
    files_before = (folder_usage(gradio_tmp) or (None, None))[0]
    sampler = RssSampler(server_pid, gradio_tmp) if server_pid else None
    if sampler:
        sampler.start()
    load_before, cpu_server0, cpu_client0 = os.getloadavg(), cpu_s(server_pid) if server_pid else None, own_cpu_s()
    wall = _run_clients(clients, seconds, worker, apis.__getitem__)
    cpu_server1, cpu_client1 = cpu_s(server_pid) if server_pid else None, own_cpu_s()
    time.sleep(1.0)  # let the server settle (answers sent, uploads closed)
    after = rss_mb(server_pid) if server_pid else None
    out = tally.summary(wall)
    out.update(_rss_fields(before, after, sampler.stop() if sampler else []))
    out.update({"clients": clients, "seconds": round(wall, 1), "client": mode,
                "loadavg_before": [round(v, 2) for v in load_before],
                "loadavg_after": [round(v, 2) for v in os.getloadavg()]})
    if tally.answered:
        out["client_cpu_ms_per_answer"] = round(1000 * (cpu_client1 - cpu_client0) / tally.answered, 1)
        if cpu_server0 is not None and cpu_server1 is not None:
            out["server_cpu_ms_per_answer"] = round(1000 * (cpu_server1 - cpu_server0) / tally.answered, 1)
    if sampler is not None and sampler.folder_samples:
        out["upload_files_max"] = max(f for f, _ in sampler.folder_samples)
        out["upload_mb_max"] = round(max(b for _, b in sampler.folder_samples) / 2**20, 1)
    if server_ms:
        out["server_p50_ms"] = round(float(np.percentile(server_ms, 50)), 2)
        out["server_p99_ms"] = round(float(np.percentile(server_ms, 99)), 2)
    if gradio_tmp is not None:
        files = [q for q in gradio_tmp.rglob("*") if q.is_file() and not q.name.startswith(".")]
        out["upload_files_before"], out["upload_files_after"] = files_before, len(files)
        out["upload_bytes_after"] = sum(q.stat().st_size for q in files)
        out["upload_empty_files_after"] = sum(q.stat().st_size == 0 for q in files)
    return out


# ---------------------------------------------------------------------------- report
def row(name: str, r: dict) -> str:
    growth = "-" if r.get("rss_growth_mb") is None else f"{r['rss_growth_mb']:+.1f}"
    return (f"{name:<18} {r['clients']:>7} {r['sent']:>7} {r['answered']:>8} {r['busy']:>6} {r['failed']:>6} "
            f"{r['lost']:>5} {r['answered_per_s']:>7.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {growth:>9}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    ap.add_argument("--seconds", type=float, default=30.0, help="duration of each phase (default 30)")
    ap.add_argument("--model", default=None, help="exported model (default: a stand-in of the student's shape)")
    ap.add_argument("--url", default=None, help="a running app to drive instead of starting one (127.0.0.1 only)")
    ap.add_argument("--server-pid", type=int, default=None, help="its process id, for the RSS figures")
    ap.add_argument("--overload", action="store_true",
                    help="also drive a server whose Gradio queue is smaller than the clients")
    ap.add_argument("--no-app", action="store_true", help="the batcher phases only")
    ap.add_argument("--phases", default="batcher,batcher_overload,app,app_http,app_overload",
                    help="comma-separated phases to run (default: all; app_overload only with --overload)")
    ap.add_argument("--photos", type=int, default=16, help="distinct photos sent (default 16)")
    ap.add_argument("--keep-uploads-minutes", type=float, default=None,
                    help="the server's --keep-uploads-minutes (default: the server's own default)")
    args = ap.parse_args(argv)
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        ap.error("--url must be on 127.0.0.1 (this benchmark never loads another machine)")

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="leaflens-load-") as tmp_s:
        tmp = Path(tmp_s)
        model = Path(args.model) if args.model else build_standin(tmp / "standin.onnx")
        photo_paths = make_photos(tmp / "photos", args.photos)
        predictor = Predictor(model)
        decoded = [predictor.decode(p) for p in photo_paths]
        print(f"model {model.name} ({predictor.card.input_size}px, {len(predictor.classes)} classes) on "
              f"{predictor.provider}; {args.clients} clients, {args.seconds:.0f} s per phase", flush=True)

        wanted = set(args.phases.split(","))
        if "batcher" in wanted:
            results["batcher"] = batcher_phase(predictor, decoded, args.clients, args.seconds, max_queue=256)
        if "batcher_overload" in wanted:
            results["batcher_overload"] = batcher_phase(predictor, decoded, args.clients, min(args.seconds, 10.0),
                                                        max_queue=max(1, args.clients // 4))
        if not args.no_app:
            # (phase, client, Gradio queue size): the queue of `leaflens serve` by default (64), and a queue
            # smaller than the clients for the overload phase
            phases = [("app", "gradio_client", None), ("app_http", "http", None)]
            if args.overload:
                phases.append(("app_overload", "http", max(1, args.clients // 4)))
            for name, mode, queue_size in [ph for ph in phases if ph[0] in wanted]:
                gradio_tmp = tmp / f"gradio_{name}"
                if args.url and queue_size is None:
                    url, proc, pid, log = args.url.rstrip("/") + "/", None, args.server_pid, None
                else:
                    port, log = free_port(), tmp / f"{name}.log"
                    proc = start_server(model, port, gradio_tmp, queue_size, log, args.keep_uploads_minutes)
                    url, pid = f"http://127.0.0.1:{port}/", proc.pid
                try:
                    wait_ready(url, proc, log)
                    seconds = args.seconds if queue_size is None else min(args.seconds, 15.0)
                    results[name] = app_phase(url, pid, photo_paths, predictor, args.clients, seconds,
                                              gradio_tmp if proc is not None else None, mode)
                    results[name]["gradio_queue_size"] = queue_size or 64
                finally:
                    if proc is not None:
                        stop_server(proc)

    print(f"\n{'phase':<18} {'clients':>7} {'sent':>7} {'answered':>8} {'busy':>6} {'failed':>6} {'lost':>5} "
          f"{'ans/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'RSS +MB':>9}")
    for name, r in results.items():
        print(row(name, r))
    for name, r in results.items():
        extra = [f"{k}={v}" for k, v in r.items() if k in ("max_queue", "gradio_queue_size", "client",
                                                            "server_p50_ms", "server_p99_ms", "rss_before_mb",
                                                            "rss_after_mb", "rss_max_mb",
                                                            "rss_slope_second_half_mb_per_min", "rss_trace_mb",
                                                            "upload_files_before", "upload_files_after",
                                                            "upload_bytes_after", "upload_empty_files_after",
                                                            "upload_files_max", "upload_mb_max",
                                                            "server_cpu_ms_per_answer", "client_cpu_ms_per_answer",
                                                            "loadavg_before", "loadavg_after")]
        print(f"  {name}: " + ", ".join(extra) + (f"; errors {r['errors']}" if r["errors"] else ""))
    if not results:
        ap.error(f"no phase selected by --phases {args.phases!r}")
    head = results.get("app") or next(iter(results.values()))
    keys = ("sent", "answered", "busy", "failed", "lost", "p50_ms", "p99_ms", "rss_growth_mb")
    summary = {k: head[k] for k in keys}
    summary.update({"clients": args.clients, "seconds": args.seconds,
                    "source": "app" if "app" in results else next(iter(results))})
    for name in ("app", "app_http"):  # the app's headline figures, under their own keys
        if name in results:
            summary[f"{name}_p50_ms"] = results[name]["p50_ms"]
            summary[f"{name}_answers_per_s"] = results[name]["answered_per_s"]
    apps = [results[n] for n in ("app", "app_http", "app_overload") if n in results]
    # the memory trend of the full-length phases (the overload one lasts 15 s at most: too short for a slope)
    slopes = [r.get("rss_slope_second_half_mb_per_min") for r in apps[:2] if r is not results.get("app_overload")]
    if any(v is not None for v in slopes):
        summary["app_rss_slope_mb_per_min"] = max(v for v in slopes if v is not None)
    if any("upload_files_max" in r for r in apps):
        summary["app_upload_files_max"] = max(r.get("upload_files_max", 0) for r in apps)
        summary["app_upload_mb_max"] = max(r.get("upload_mb_max", 0.0) for r in apps)
    summary["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    summary["phases"] = results
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ModelError, OSError) as exc:  # a missing or unreadable model or folder: one line, no traceback
        sys.exit(f"load.py: {exc}")
