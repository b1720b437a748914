"""What is served is what was measured: for 4000x3000 phone JPEGs (EXIF-rotated) in a dataset stored at 128 px
for a 64 px model, the Predictor's input for a photo file equals, bit for bit, the input the engine's
evaluation (train_student.predict_logits) gives the model for the same photo.

Both decode the file with the same call at the stored size (so the JPEG draft scale is the same: no
one-grey-level allowance is needed), then area-average and normalise with the same functions."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))

from apps_helpers import build_tiny_model, tiny_weights  # noqa: E402

from leaflens.apps.model_card import ModelCard  # noqa: E402
from leaflens.apps.predictor import Predictor  # noqa: E402
from leaflens.data_prep.contract import contract_for_dataset  # noqa: E402
from leaflens.data_prep.decode import decode_image  # noqa: E402
from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset  # noqa: E402
from leaflens.engine import Tensor, nn  # noqa: E402
from leaflens.pipeline.train_student import predict_logits  # noqa: E402

STORED, INPUT = 128, 64
CLASSES = ["blight", "healthy"]


def phone_jpeg(seed: int, orientation: int | None, size: tuple[int, int] = (4000, 3000)) -> bytes:
    """A phone-sized JPEG with coarse structure and fine texture (what makes resize paths disagree)."""
    w, h = size
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (h // 50, w // 50, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR))
    tile = rng.integers(0, 48, (40, 40, 3), dtype=np.uint8)
    pixels = base // 2 + np.tile(tile, (h // 40, w // 40, 1))
    kw = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def phone_photos(tmp_path_factory) -> Path:
    """photos/<class>/*.jpg: 4000x3000 and 3000x4000 JPEGs, EXIF orientations 6, 8, 3 and none."""
    root = tmp_path_factory.mktemp("phone") / "photos"
    specs = [(6, (4000, 3000)), (8, (4000, 3000)), (3, (3000, 4000)), (None, (4000, 3000))]
    for c, cls in enumerate(CLASSES):
        (root / cls).mkdir(parents=True)
        for i, (orientation, size) in enumerate(specs):
            (root / cls / f"IMG_{c}{i}.jpg").write_bytes(phone_jpeg(10 * c + i, orientation, size))
    return root


class Recorder(nn.Module):
    """Stands in for the student: keeps the input evaluation gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[np.ndarray] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.numpy().copy())
        return Tensor(np.zeros((x.shape[0], len(CLASSES)), np.float32))


@pytest.mark.parametrize("resize", ["crop", "pad"])
def test_predictor_input_equals_the_evaluation_input_for_phone_photos(phone_photos, tmp_path, resize):
    ds_dir = tmp_path / "dataset"
    ingest(phone_photos, ds_dir, IngestOptions(size=STORED, resize=resize, ratios=(0.5, 0.25, 0.25)), workers=1,
           log=lambda s: None)
    ds = load_dataset(ds_dir)
    card = ModelCard(classes=tuple(CLASSES), contract=contract_for_dataset(ds, INPUT))
    model_path = build_tiny_model(tmp_path / "m.onnx", tiny_weights(len(CLASSES)), INPUT, card.to_metadata())
    predictor = Predictor(model_path, intra_op_threads=1)
    assert predictor.card == card and predictor.stored_size == STORED

    rows = np.concatenate([np.asarray(ds[s].images) for s in ("train", "val", "test")])
    files = [phone_photos / f for s in ("train", "val", "test") for f in ds[s].files]
    assert len(files) == 8 and rows.shape == (8, STORED, STORED, 3)
    recorder = Recorder()
    predict_logits(recorder, rows, ds.mean, ds.std, batch=5, size=INPUT)  # the engine's evaluation path
    measured = np.concatenate(recorder.seen)
    assert measured.shape == (8, INPUT, INPUT, 3)

    decoded = np.stack([predictor.decode(f) for f in files])
    np.testing.assert_array_equal(decoded, rows)  # step 1: the very pixels preprocess stored
    served = predictor.preprocess(decoded).transpose(0, 2, 3, 1)  # NCHW -> NHWC
    np.testing.assert_array_equal(served, measured)
    for i in (0, 5):  # batch of one (the web app's usual case) as well
        np.testing.assert_array_equal(predictor.preprocess(predictor.decode(files[i])[None])[0].transpose(1, 2, 0),
                                      measured[i])

    # What the Predictor used to do, decode straight to the input size, was several grey levels off.
    straight = np.stack([decode_image(f, INPUT, resize) for f in files]).astype(np.float32)
    grey_levels = np.abs(straight / 255.0 - (measured * ds.std + ds.mean)).max() * 255.0
    assert grey_levels > 2.0
