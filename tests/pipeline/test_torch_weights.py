"""pipeline.models.torch_weights: PyTorch checkpoints read without torch, and without running what they name."""

from __future__ import annotations

import collections
import zipfile

import numpy as np
import pytest
from pth_checkpoint_files import TensorSpec, call, glob, write_legacy, write_zip

from leaflens.pipeline.models.torch_weights import (
    ALLOWED_GLOBALS,
    CheckpointFormatError,
    UnsafeCheckpointError,
    load_torch_state_dict,
    read_torch_checkpoint,
)

WRITERS = {"legacy": write_legacy, "zip": write_zip}


def _entries():
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(40).astype(np.float32)
    return {
        # a transposed, offset view into a shared storage: (3, 4) read with strides (1, 5) from element 7
        "conv.weight": TensorSpec("0", flat, 7, (3, 4), (1, 5)),
        "bn.num_batches_tracked": TensorSpec.of("1", np.array(12, dtype=np.int64)),
        "half": TensorSpec.of("2", rng.standard_normal((2, 3)).astype(np.float16)),
        "double": TensorSpec.of("3", rng.standard_normal(5)),
        "mask": TensorSpec.of("4", np.array([True, False, True])),
        "bytes": TensorSpec.of("5", np.arange(6, dtype=np.uint8).reshape(2, 3)),
        "same.storage": TensorSpec("0", flat, 0, (2, 2), (2, 1)),
    }


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_crafted_checkpoint_round_trips(tmp_path, fmt):
    entries = _entries()
    path = WRITERS[fmt](tmp_path / f"{fmt}.pth", entries)
    sd = load_torch_state_dict(path)
    assert list(sd) == list(entries)
    for key, spec in entries.items():
        want = spec.expected()
        assert sd[key].dtype == want.dtype, key
        assert sd[key].shape == want.shape, key
        np.testing.assert_array_equal(sd[key], want, err_msg=key)
        assert sd[key].flags.c_contiguous and sd[key].flags.writeable
    np.testing.assert_array_equal(sd["conv.weight"], entries["conv.weight"].storage[7:27].reshape(4, 5)[:, :3].T)


FORBIDDEN = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
             ("subprocess", "Popen"), ("torch", "load"), ("torch._utils", "_rebuild_parameter"),
             ("collections", "OrderedDict.fromkeys")]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize("module,name", FORBIDDEN)
def test_any_other_global_is_refused_and_nothing_runs(tmp_path, fmt, module, name):
    marker = tmp_path / "pwned"
    if name in ("eval", "exec"):
        payload = call(module, name, f"open({str(marker)!r}, 'w').write('x')")
    elif name == "system":
        payload = call(module, name, f"touch {marker}")
    elif name == "Popen":
        payload = call(module, name, "touch", str(marker))
    else:
        payload = call(module, name, str(marker))
    entries = {"ok": TensorSpec.of("0", np.ones(3, np.float32)), "evil": payload}
    path = WRITERS[fmt](tmp_path / "evil.pth", entries)
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}".replace(".", r"\.")) as info:
        read_torch_checkpoint(path)
    assert info.value.global_name == f"{module}.{name}"
    assert not marker.exists(), "the forbidden call ran"


def test_the_plain_pickle_would_have_run_the_payload(tmp_path):
    """The same bytes do execute under plain pickle: proves the marker test above can fail."""
    import pickle

    marker = tmp_path / "ran"
    from pth_checkpoint_files import state_dict_pickle

    data = state_dict_pickle({"evil": call("builtins", "eval", f"open({str(marker)!r}, 'w').write('x')")})
    pickle.loads(data)
    assert marker.exists()


def test_build_cannot_monkeypatch_the_admitted_globals(tmp_path):
    # BUILD on the admitted OrderedDict global with slot state {"__repr__": <str>}: with the real class
    # handed out, this would patch collections.OrderedDict process-wide.
    attack = glob("collections", "OrderedDict") + b"N}X\x08\x00\x00\x00__repr__X\x01\x00\x00\x00xs\x86b0"
    path = write_legacy(tmp_path / "patch.pth", {"a": TensorSpec.of("0", np.zeros(2, np.float32))}, extra=attack)
    before = collections.OrderedDict.__repr__
    with pytest.raises(CheckpointFormatError, match="read-only"):
        read_torch_checkpoint(path)
    assert collections.OrderedDict.__repr__ is before


def test_strides_reaching_past_the_storage_are_refused(tmp_path):
    flat = np.arange(10, dtype=np.float32)
    path = write_zip(tmp_path / "oob.pth", {"w": TensorSpec("0", flat, 2, (3, 4), (4, 1))})
    with pytest.raises(CheckpointFormatError, match="past the end of storage"):
        read_torch_checkpoint(path)


def test_truncated_and_inconsistent_files_are_refused(tmp_path):
    entries = {"w": TensorSpec.of("0", np.arange(6, dtype=np.float32))}
    good = write_legacy(tmp_path / "good.pth", entries).read_bytes()
    (tmp_path / "cut.pth").write_bytes(good[:-8])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        read_torch_checkpoint(tmp_path / "cut.pth")
    write_legacy(tmp_path / "count.pth", entries, corrupt_count=True)
    with pytest.raises(CheckpointFormatError, match="declares 7 elements"):
        read_torch_checkpoint(tmp_path / "count.pth")
    (tmp_path / "text.pth").write_text("not a checkpoint at all")
    with pytest.raises(CheckpointFormatError, match="not a PyTorch checkpoint"):
        read_torch_checkpoint(tmp_path / "text.pth")
    with zipfile.ZipFile(tmp_path / "nodata.pth", "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}.")
    assert read_torch_checkpoint(tmp_path / "nodata.pth") == {}
    with pytest.raises(CheckpointFormatError, match="not a state dict"):
        load_torch_state_dict(write_zip(tmp_path / "list.pth", {}, extra=b"0]"))
    with pytest.raises(FileNotFoundError):
        read_torch_checkpoint(tmp_path / "missing.pth")


def test_allow_list_is_exactly_the_tensor_rebuild_entries():
    assert set(ALLOWED_GLOBALS) == {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2"} | {
        f"torch.{k}Storage" for k in ("Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
                                      "Bool")}
