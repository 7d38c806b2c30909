"""The image data step's pieces without Great Expectations: decoding, splitting, captions, config, tar reading."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from tasks.prepare.config import PrepareConfig
from tasks.prepare.images import SourceImage, caption_ids, decode_image, read_source, split_images
from tasks.prepare.tokenizer import TextTokenizer
from training.storage import StorageConfig


def _png(array: np.ndarray, **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG", **save)
    return buffer.getvalue()


def test_decode_crops_the_centred_square_and_resizes_like_pillow() -> None:
    array = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    fields, pixels = decode_image(_png(array), 8)
    expected = np.asarray(Image.fromarray(array[:, 5:25]).resize((8, 8), Image.Resampling.BICUBIC))
    assert fields["width"] == 30 and fields["height"] == 20 and fields["mode"] == "RGB"
    assert pixels is not None and np.array_equal(pixels, expected)


def test_decode_applies_exif_orientation() -> None:
    image = Image.fromarray(np.zeros((10, 20, 3), dtype=np.uint8))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    fields, _ = decode_image(buffer.getvalue(), 8)
    assert (fields["width"], fields["height"]) == (10, 20)


def test_grayscale_and_cmyk_are_converted_and_their_mode_recorded() -> None:
    gray = np.full((16, 16), 200, dtype=np.uint8)
    fields, pixels = decode_image(_png(gray), 8)
    assert fields["mode"] == "L" and pixels is not None and pixels.shape == (8, 8, 3) and (pixels == 200).all()
    buffer = io.BytesIO()
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(buffer, format="JPEG")
    fields, pixels = decode_image(buffer.getvalue(), 8)
    assert fields["mode"] == "CMYK" and pixels is not None


def test_sixteen_bit_images_are_not_converted() -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.full((16, 16), 40000, dtype=np.uint16)).save(buffer, format="PNG")
    fields, pixels = decode_image(buffer.getvalue(), 8)
    assert fields["mode"].startswith("I") and fields["decodable"] and pixels is None


def test_cut_short_file_is_undecodable_with_the_reason() -> None:
    data = _png(np.zeros((16, 16, 3), dtype=np.uint8))
    fields, pixels = decode_image(data[: len(data) // 2], 8)
    assert fields["decodable"] is False and fields["error"] and pixels is None


def test_label_split_is_stratified_and_seeded() -> None:
    images = [SourceImage(f"{c}/{i}", bytes, label=c) for c in range(3) for i in range(20)]
    first = split_images(images, "labels", 0.25, seed=7)
    assert first == split_images(images, "labels", 0.25, seed=7)
    assert first != split_images(images, "labels", 0.25, seed=8)
    for c in range(3):
        assert sum(s == "val" for s, image in zip(first, images, strict=True) if image.label == c) == 5


def test_given_splits_are_kept() -> None:
    images = [SourceImage("a", bytes, label=0, split="val"), SourceImage("b", bytes, label=0, split="train")]
    assert split_images(images, "labels", 0.5, seed=0) == ["val", "train"]


def test_captions_end_with_eos_and_are_padded_with_it() -> None:
    ids, lengths = caption_ids(TextTokenizer("bytes"), ["ab", "abcdef"], 4)
    assert lengths == [2, 6]
    assert ids.tolist() == [[97, 98, 256, 256, 256], [97, 98, 99, 100, 256]]


def test_image_config_does_not_need_text_sources() -> None:
    cfg = PrepareConfig(output_url="/tmp/o", images={"kind": "imagefolder", "path": "/x", "image_size": 32})
    assert cfg.images is not None and cfg.images.target_kind == "labels"
    with pytest.raises(ValidationError, match="give at least one source"):
        PrepareConfig(output_url="/tmp/o")


@pytest.mark.parametrize(
    ("images", "extra", "message"),
    [
        ({"kind": "imagefolder", "label_column": "label"}, {}, "takes its labels from the class folders"),
        ({"kind": "hf"}, {}, "set exactly one of label_column"),
        ({"kind": "hf", "label_column": "l", "caption_column": "c"}, {}, "set exactly one of label_column"),
        ({"kind": "imagefolder", "class_names": ["a", "a"]}, {}, "names a class twice"),
        ({"kind": "imagefolder", "class_names": ["../up"]}, {}, "no '/'"),
        ({"kind": "imagefolder"}, {"sources": ["a.txt"]}, "text sources are not read"),
    ],
)
def test_image_config_refuses_contradictions(images: dict, extra: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PrepareConfig(output_url="/tmp/o", images={"path": "/x", "image_size": 32, **images}, **extra)


def test_webdataset_members_are_grouped_by_key(tmp_path: Path) -> None:
    shard = tmp_path / "shard-0.tar"
    members = {"a/x1.png": _png(np.zeros((16, 16, 3), dtype=np.uint8)), "a/x1.txt": b"red stripes\n",
               "a/x2.jpg": b"junk", "a/x2.txt": b"blue"}  # fmt: skip
    with tarfile.open(shard, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    images = {"kind": "webdataset", "path": str(shard), "image_size": 8, "caption_column": "txt"}
    cfg = PrepareConfig(output_url="/tmp/o", tokenizer={"kind": "bytes"}, images=images)
    source = read_source(cfg.images, StorageConfig())
    assert [(i.name, i.caption) for i in source.images] == [
        ("shard-0.tar:a/x1.png", "red stripes"), ("shard-0.tar:a/x2.jpg", "blue")]  # fmt: skip
    assert source.images[1].read() == b"junk"



def test_a_symbolic_link_in_the_folder_is_not_followed(tmp_path: Path) -> None:
    from tasks.prepare.images import _decode_one

    (tmp_path / "src" / "cat").mkdir(parents=True)
    outside = tmp_path / "outside.png"
    outside.write_bytes(_png(np.zeros((16, 16, 3), dtype=np.uint8)))
    (tmp_path / "src" / "cat" / "link.png").symlink_to(outside)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.png").write_bytes(outside.read_bytes())
    (tmp_path / "src" / "dog").symlink_to(tmp_path / "elsewhere")
    images = {"kind": "imagefolder", "path": str(tmp_path / "src"), "image_size": 8}
    cfg = PrepareConfig(output_url="/tmp/o", images=images)
    source = read_source(cfg.images, StorageConfig())  # a linked folder is not entered
    [row] = [_decode_one(image, 8, validate=True, hashes=False).row for image in source.images]
    assert row.file == "cat/link.png" and not row.decodable and "symbolic link" in row.error
