"""The image data step end to end (Great Expectations included): planted defects each named at once, a clean
ImageFolder written and read back bit-exact and reused, the hf and WebDataset sources prepared."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.prepare.config import DataSpec, PrepareConfig
from tasks.prepare.images import prepare_images
from tasks.prepare.pipeline import DataValidationError
from tasks.prepare.step import DataInputs, run
from training.image_dataset import MANIFEST, ImageDataset
from training.storage import StorageConfig

pytestmark = pytest.mark.integration

SIZE = 16


def _noise(rng: np.random.Generator, height: int = 24, width: int = 20) -> np.ndarray:
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def _folder(root: Path, per_class: int = 6, seed: int = 0) -> Path:
    """train/<class>/ and val/<class>/ of random images (the split kept as given)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", 2)):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for number in range(count):
                Image.fromarray(_noise(rng)).save(root / split / name / f"{number}.png")
    return root


def _expected(path: Path) -> np.ndarray:
    """The definition: RGB, centred square crop, bicubic resize (Pillow directly)."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
    side = min(rgb.size)
    left, top = (rgb.width - side) // 2, (rgb.height - side) // 2
    square = rgb.crop((left, top, left + side, top + side))
    return np.asarray(square.resize((SIZE, SIZE), Image.Resampling.BICUBIC))


def _images(path: Path, **extra: object) -> dict:
    return {"kind": "imagefolder", "path": str(path), "image_size": SIZE, **extra}


def test_planted_defects_fail_the_data_step_naming_each_and_nothing_is_committed(tmp_path: Path) -> None:
    root = _folder(tmp_path / "src")
    rng = np.random.default_rng(1)
    (root / "train" / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    Image.fromarray(_noise(rng, 8, 8)).save(root / "train" / "dog" / "tiny.png")
    (root / "train" / "zebra").mkdir()
    Image.fromarray(_noise(rng)).save(root / "train" / "zebra" / "z.png")
    shutil.copy(root / "train" / "cat" / "0.png", root / "val" / "cat" / "copy.png")
    near = np.asarray(Image.open(root / "train" / "dog" / "1.png")).astype(int) + rng.integers(-2, 3, (24, 20, 3))
    Image.fromarray(np.clip(near, 0, 255).astype(np.uint8)).save(root / "val" / "dog" / "near.png")
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), images=_images(root, class_names=["cat", "dog"]))

    with pytest.raises(DataValidationError) as err:
        prepare_images(cfg, StorageConfig())
    message = str(err.value)
    for named in (
        "train/cat/broken.png: not a decodable image",
        "train/dog/tiny.png: 8x8 px, its shorter side is below min_side_px=16",
        "train/zebra/z.png: class 'zebra' is not one of class_names ['cat', 'dog']",
        "val/cat/copy.png (val) has the same pixels as train/cat/0.png",
        "val/dog/near.png (val) is a near-duplicate of train/dog/1.png (train)",
    ):
        assert named in message
    assert len(err.value.problems) == 5
    folder = Path(err.value.report_url).parent.parent
    assert not (folder / MANIFEST).exists()
    report = json.loads(Path(err.value.report_url).read_text())
    assert report["success"] is False and len(report["problems"]) == 5
    assert Path(err.value.docs_url).is_file()


def test_clean_folder_is_written_read_back_bit_exact_and_reused(tmp_path: Path) -> None:
    root = _folder(tmp_path / "src")
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), images=_images(root))
    inputs = DataInputs(data=DataSpec(prepare=cfg), vocab_size=2, storage=StorageConfig(), reports_dir=str(tmp_path))
    first = run(inputs)
    assert first.splits == {"train": {"images": 12}, "val": {"images": 4}} and not first.reused
    assert first.validation["success"] is True and first.artifact_problem(inputs) is None
    assert "train 12 images" in first.summary()

    dataset = ImageDataset(first.dataset_url, "val", expect_kind="labels")
    assert dataset.manifest.class_names == ["cat", "dog"]
    batch = dataset.batch(range(len(dataset)))
    files = sorted((root / "val").glob("*/*.png"))  # the reader keeps the source's order: class, then name
    expected = np.stack([_expected(path) for path in files])
    assert np.array_equal(batch.images.permute(0, 2, 3, 1).numpy(), expected)
    assert batch.targets.tolist() == [0, 0, 1, 1]

    again = run(inputs)
    assert again.reused and again.dataset_url == first.dataset_url and again.validation["success"] is True


def test_hf_labels_and_webdataset_captions_are_prepared(tmp_path: Path) -> None:
    import datasets

    rng = np.random.default_rng(2)
    pngs = []
    for _ in range(12):
        buffer = io.BytesIO()
        Image.fromarray(_noise(rng)).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    table = {"image": [{"bytes": p, "path": None} for p in pngs], "label": [n % 2 for n in range(12)]}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "hf"))
    cfg = PrepareConfig(output_url=str(tmp_path / "out"),
                        images={"kind": "hf", "path": str(tmp_path / "hf"), "image_size": SIZE, "label_column": "label",
                                "val_fraction": 0.25})  # fmt: skip
    labels = prepare_images(cfg, StorageConfig())
    assert labels.splits == {"train": {"images": 8}, "val": {"images": 4}}
    assert ImageDataset(labels.dataset_url, "train").manifest.class_names == ["a", "b"]

    with tarfile.open(tmp_path / "shard-000.tar", "w") as tar:
        for number, png in enumerate(pngs):
            for name, data in ((f"{number:04d}.png", png), (f"{number:04d}.txt", f"pattern {number}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    cfg = PrepareConfig(output_url=str(tmp_path / "out"), tokenizer={"kind": "bytes"},
                        images={"kind": "webdataset", "path": str(tmp_path / "shard-000.tar"), "image_size": SIZE,
                                "caption_column": "txt", "max_caption_tokens": 12})  # fmt: skip
    captions = prepare_images(cfg, StorageConfig())
    dataset = ImageDataset(captions.dataset_url, "train", expect_kind="captions")
    ids = dataset.batch([0]).targets[0].tolist()
    assert len(ids) == 13 and ids[-1] == 256
    assert bytes(i for i in ids if i < 256).decode().startswith("pattern ")
