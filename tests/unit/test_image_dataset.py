"""The prepared image dataset format: round trips, and each corruption refused naming its file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from training.dataset import TokenizerInfo
from training.image_dataset import (
    MANIFEST,
    ImageDataset,
    ImageDatasetError,
    read_image_manifest,
    write_image_dataset,
)


def _labels(tmp_path: Path, n: int = 10, shard_images: int = 4) -> tuple[str, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    labels = rng.integers(0, 3, n)
    url = str(tmp_path / "ds")
    splits = {"train": (images, labels), "val": (images[:2], labels[:2])}
    write_image_dataset(url, None, splits, kind="labels", num_classes=3, class_names=["a", "b", "c"],
                        source_fingerprint="f", shard_images=shard_images)  # fmt: skip
    return url, images, labels


def _edit_manifest(url: str, edit) -> None:
    path = Path(url) / MANIFEST
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def test_labels_round_trip_bit_exact_across_shards(tmp_path: Path) -> None:
    url, images, labels = _labels(tmp_path)
    ds = ImageDataset(url, "train", expect_kind="labels")
    assert len(ds) == 10 and len(ds.manifest.splits["train"].shards) == 3
    order = [9, 0, 5, 4, 3]
    batch = ds.batch(order)
    assert batch.images.shape == (5, 3, 8, 8) and str(batch.images.dtype) == "torch.uint8"
    assert np.array_equal(batch.images.permute(0, 2, 3, 1).numpy(), images[order])
    assert batch.targets.tolist() == labels[order].tolist()


def test_captions_round_trip_on_an_fsspec_url() -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (5, 4, 4, 3), dtype=np.uint8)
    captions = rng.integers(0, 50, (5, 6))
    url = "memory://h1-captions/ds"
    tok = TokenizerInfo(kind="bytes")
    write_image_dataset(url, None, {"train": (images, captions)}, kind="captions", vocab_size=50, eos_id=1,
                        pad_id=0, tokenizer=tok, source_fingerprint="f", shard_images=2)  # fmt: skip
    ds = ImageDataset(url, "train", expect_kind="captions")
    batch = ds.batch([4, 1])
    assert batch.targets.shape == (2, 6) and batch.targets.tolist() == captions[[4, 1]].tolist()
    assert np.array_equal(batch.images.permute(0, 2, 3, 1).numpy(), images[[4, 1]])


def test_unfinished_dataset_is_refused(tmp_path: Path) -> None:
    url, _, _ = _labels(tmp_path)
    (Path(url) / MANIFEST).unlink()
    with pytest.raises(ImageDatasetError, match="unfinished"):
        ImageDataset(url, "train")


def test_wrong_kind_is_refused(tmp_path: Path) -> None:
    url, _, _ = _labels(tmp_path)
    with pytest.raises(ImageDatasetError, match="kind=labels, the run needs kind=captions"):
        ImageDataset(url, "train", expect_kind="captions")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["splits"]["train"]["shards"][0].update(images="../etc/passwd"), r"shards\[0\] names"),
        (lambda m: m["splits"]["train"]["shards"][0].update(bytes=5), r"bytes=5"),
        (lambda m: m["splits"]["train"].update(count=99), r"splits.train.count=99"),
        (lambda m: m.update(class_names=["a"]), r"class_names has 1 names"),
        (lambda m: m.update(class_names=["a", "b", "c\x1b[2J"]), r"class_names holds a control character"),
        (lambda m: m.update(format_version=7), r"format_version=7"),
        (lambda m: m["splits"].update({"a/b": m["splits"]["val"]}), r"split name 'a/b'"),
    ],
)
def test_manifest_that_no_writer_makes_is_refused(tmp_path: Path, edit, message: str) -> None:
    url, _, _ = _labels(tmp_path)
    _edit_manifest(url, edit)
    with pytest.raises(ImageDatasetError, match=message) as err:
        read_image_manifest(url)
    assert err.value.file == MANIFEST


def test_truncated_shard_is_refused_on_open(tmp_path: Path) -> None:
    url, _, _ = _labels(tmp_path)
    path = Path(url) / "train-00001.images.u8"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ImageDatasetError, match="train-00001.images.u8 holds") as err:
        ImageDataset(url, "train")
    assert err.value.file == "train-00001.images.u8"


def test_changed_shard_is_refused_on_first_read(tmp_path: Path) -> None:
    url, _, _ = _labels(tmp_path)
    path = Path(url) / "train-00002.images.u8"
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = ImageDataset(url, "train")
    ds.batch([0, 1])  # shard 0 is fine
    with pytest.raises(ImageDatasetError, match="train-00002.images.u8: sha256 differs") as err:
        ds.batch([9])
    assert err.value.file == "train-00002.images.u8"


def test_label_out_of_range_is_refused_even_with_a_matching_digest(tmp_path: Path) -> None:
    url, _, _ = _labels(tmp_path)
    path = Path(url) / "train-00000.targets.i32"
    values = np.frombuffer(path.read_bytes(), dtype="<i4").copy()
    values[2] = 3
    path.write_bytes(values.tobytes())
    digest = hashlib.sha256(values.tobytes()).hexdigest()
    _edit_manifest(url, lambda m: m["splits"]["train"]["shards"][0].update(targets_sha256=digest))
    with pytest.raises(ImageDatasetError, match=r"image 2 has label 3 outside \[0, num_classes=3\)") as err:
        ImageDataset(url, "train").batch([0])
    assert err.value.file == "train-00000.targets.i32"


def test_writer_refuses_targets_outside_the_classes(tmp_path: Path) -> None:
    images = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        write_image_dataset(str(tmp_path / "x"), None, {"train": (images, np.array([0, 2]))}, kind="labels",
                            num_classes=2, source_fingerprint="f")  # fmt: skip
    assert not (tmp_path / "x" / MANIFEST).exists()


def test_rewrite_uncommits_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, images, labels = _labels(tmp_path)
    import training.image_dataset as module

    def fail(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(module, "write_bytes_atomic", fail)
    with pytest.raises(OSError):
        write_image_dataset(url, None, {"train": (images, labels)}, kind="labels", num_classes=3,
                            source_fingerprint="g")  # fmt: skip
    with pytest.raises(ImageDatasetError, match="unfinished"):
        read_image_manifest(url)
