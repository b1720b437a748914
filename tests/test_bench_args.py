"""The benchmarks' command lines: a bad value is a usage error (exit 2, argparse's one error line) and a missing
folder or file a failure of one line naming it (exit 1), both before any work and without a traceback. Each run
stops at its checks, in about a second."""

from __future__ import annotations

import argparse

import pytest
from bench_helpers import assert_refused, load_benchmark, run_script


@pytest.fixture(scope="module")
def args_module():
    return load_benchmark("_args.py")


def test_positive_types_refuse_zero_negative_and_words(args_module):
    assert args_module.positive_int("3") == 3
    assert args_module.positive_float("0.5") == 0.5
    assert args_module.non_negative_float("0") == 0.0
    assert args_module.positive_ints("1, 8,,32") == [1, 8, 32]
    assert args_module.positive_ints("") == []
    for fn, text in ((args_module.positive_int, "0"), (args_module.positive_int, "abc"),
                     (args_module.positive_float, "0"), (args_module.positive_float, "nan"),
                     (args_module.positive_float, "inf"), (args_module.non_negative_float, "-1"),
                     (args_module.positive_ints, "1,abc"), (args_module.positive_ints, "4,0")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_existing_dir_and_checked_config_are_usage_errors(args_module, tmp_path):
    assert args_module.existing_dir(str(tmp_path)) == tmp_path
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        args_module.existing_dir(str(tmp_path / "nowhere"))
    parser = argparse.ArgumentParser(prog="x")
    assert args_module.checked_config(parser, ["train.epochs=3"]).train.epochs == 3
    with pytest.raises(SystemExit) as exc:
        args_module.checked_config(parser, ["bogus"])
    assert exc.value.code == 2


@pytest.mark.parametrize(("script", "args", "option"), [
    ("serve.py", ["--seconds", "0"], "--seconds"),
    ("serve.py", ["--clients", "abc"], "--clients"),
    ("serve.py", ["--rounds", "0"], "--rounds"),
    ("app_latency.py", ["--repeats", "0", "--no-http"], "--repeats"),
    ("loader.py", ["--images", "0"], "--images"),
    ("loader.py", ["--batch", "0"], "--batch"),
    ("loader.py", ["--images", "8", "--batch", "16"], "--images 8"),
    ("ambiguous_small_val.py", ["--case", "t", "d", "--sizes", "abc"], "--sizes"),
    ("ambiguous_small_val.py", ["--case", "t", "d", "--case", "t", "d2"], "--case"),
    ("preprocess.py", ["--checks-only", "--checks-src", "/nonexistent"], "/nonexistent"),
    ("preprocess.py", ["--checks-only"], "--checks-src"),
    ("ood_embedding.py", ["--teacher", "/x", "--dataset", "/x", "--photos", "/nonexistent"], "--photos"),
    ("near_ties.py", ["--model", "m.onnx", "--dataset", "d", "--batch-size", "0"], "--batch-size"),
    ("fp16_arith.py", ["--export", "e", "--dataset", "d", "--photos", "0"], "--photos"),
])
def test_bad_values_are_usage_errors(script, args, option):
    assert_refused(run_script(script, *args), 2, option)


def test_missing_inputs_are_one_line_failures(tmp_path):
    assert_refused(run_script("ambiguous_small_val.py", "--case", "/nonexistent", "/nonexistent"), 1,
                   "/nonexistent/logits_val.npy")
    assert_refused(run_script("ood_embedding.py", "--teacher", "/x", "--dataset", "/x", "--photos", str(tmp_path)), 1,
                   "ood_embedding.py:", "/x")
    # a folder that `leaflens preprocess` refuses: the child's reason, not its traceback
    assert_refused(run_script("preprocess.py", "--checks-only", "--checks-src", str(tmp_path)), 1,
                   "preprocess.py:", str(tmp_path), "no class folders")
