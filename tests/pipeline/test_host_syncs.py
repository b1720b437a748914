"""A student training step reads the GPU at most twice: once for the step's verdict (loss, overflow flag,
gradient norm, deferred input checks in one transfer), plus once every ``log_every`` steps for the progress
bar's running loss. Counted on the CPU with the engine's CuPy stand-in (leaflens.engine.sync_count) over
real steps of the pipeline's student run: distillation from teacher features and logits, unlabelled rows,
gradient clipping, mixed precision (the earlier loop made 24 reads per step on this run)."""

from __future__ import annotations

import pytest

from leaflens.pipeline.host_syncs import measure_host_syncs


@pytest.mark.parametrize(("optimizer", "mixed_precision", "overrides"),
                         [("adamw", True, ()), ("sgd", False, ()), ("adamw", True, ("train.ema=0.9",))])
def test_a_training_step_reads_the_device_at_most_twice(optimizer, mixed_precision, overrides):
    """Also with the weight average (train.ema), which moves on the device after every step."""
    report = measure_host_syncs(optimizer, mixed_precision, epochs=2, log_every=4, batches_per_epoch=6,
                                overrides=overrides)
    assert len(report.per_step) == 12
    where = "\n".join(f"{n} x {site}" for site, n in report.sites.most_common())
    assert report.max_per_step <= 2, f"host reads per step {report.per_step}:\n{where}"
    # every step makes its one verdict read (the count is not blind), and the running loss is read rarely
    assert min(report.steady) == 1, report.per_step
    assert report.mean_per_step <= 1 + 1 / 4 + 1e-9, report.per_step
    assert sum(n == 2 for n in report.steady) >= 2, report.per_step  # the progress bar's reads were counted


def test_the_gpu_benchmark_reports_host_syncs_per_step_without_a_gpu(capsys):
    from bench_helpers import load_benchmark

    bench = load_benchmark("gpu.py")
    keys = bench.host_syncs_keys()
    assert keys["host_syncs_per_step"] in (1, 2)
    assert 1.0 <= keys["host_syncs_mean_per_step"] <= 1.5
    assert "host reads per training step" in capsys.readouterr().out
