"""The image suite's tables and defect messages (validation/image_data.py), without Great Expectations."""

from __future__ import annotations

import numpy as np

from validation.image_data import ImageExpectations, ImageRow, class_frame, image_frame, image_problems, split_frame


def _row(file: str, split: str, label: int = 0, sha: str | None = None, phash: int | None = None, **kw) -> ImageRow:
    fields = {"decodable": True, "width": 32, "height": 32, "mode": "RGB", "sha256": sha or file, "phash": phash}
    fields.update(kw)
    return ImageRow(file=file, split=split, label=label, **fields)


def _problems(rows: list[ImageRow], limits: ImageExpectations | None = None, num_classes: int = 2) -> list[str]:
    limits = limits or ImageExpectations(min_images=1, min_class_ratio=0)
    frame, pairs = image_frame(rows, "labels", num_classes, limits)
    classes = class_frame(frame, num_classes, ["a", "b"][:num_classes])
    return [p.problem for p in image_problems(frame, pairs, classes, split_frame(frame), "labels", num_classes,
                                              ["a", "b"][:num_classes], None, limits)]  # fmt: skip


def test_clean_rows_have_no_problems() -> None:
    rows = [_row("t1", "train", 0, phash=0), _row("t2", "train", 1, phash=2**64 - 1)]
    rows.append(_row("v1", "val", 1, phash=0xF0F0))
    assert _problems(rows) == []


def test_duplicate_across_splits_names_both_files() -> None:
    rows = [_row("train/a/1.png", "train", sha="s"), _row("val/a/9.png", "val", sha="s")]
    assert _problems(rows) == ["val/a/9.png (val) has the same pixels as train/a/1.png (another split)"]


def test_duplicates_within_a_split_count_against_their_bound() -> None:
    rows = [_row("t1", "train", sha="s"), _row("t2", "train", sha="s"), _row("v", "val")]
    assert "repeat an earlier image of their split" in _problems(rows)[0]
    assert _problems(rows, ImageExpectations(min_images=1, min_class_ratio=0, max_duplicate_fraction=0.5)) == []


def test_near_duplicate_across_splits_within_the_distance() -> None:
    rows = [_row("t", "train", phash=0b1111), _row("v", "val", phash=0b0111), _row("w", "val", phash=2**64 - 1)]
    problems = _problems(rows)
    assert problems == ["v (val) is a near-duplicate of t (train): pHash 1 bits apart, near_dup_max_distance=4"]
    off = ImageExpectations(min_images=1, min_class_ratio=0, near_dup_max_distance=None)
    assert _problems(rows, off) == []


def test_each_image_defect_is_named() -> None:
    rows = [
        _row("ok", "train"),
        ImageRow(file="broken.png", split="train", decodable=False, error="OSError: truncated"),
        _row("small.png", "train", width=8, height=40),
        _row("deep.png", "train", mode="I;16"),
        _row("zebra/z.png", "val", label=-1, label_name="zebra"),
        _row("big-label", "val", label=5),
    ]
    problems = _problems(rows, ImageExpectations(min_images=1, min_class_ratio=0, max_converted_fraction=1))
    assert problems == [
        "broken.png: not a decodable image (OSError: truncated)",
        "small.png: 8x40 px, its shorter side is below min_side_px=16",
        "deep.png: mode I;16 (more than 8 bits per channel) cannot become 8-bit RGB without clipping",
        "zebra/z.png: class 'zebra' is not one of class_names ['a', 'b']",
        "big-label: label=5 is outside [0, num_classes=2)",
    ]


def test_class_balance_and_converted_share() -> None:
    rows = [_row(f"a{i}", "train", 0, mode="L") for i in range(10)] + [_row("b", "val", 1)]
    problems = _problems(rows, ImageExpectations(min_images=1))
    assert any(p.startswith("90.9% of the images were not RGB ({'L': 10}") for p in problems)
    assert any(p.startswith("class 'b': 1 images, 0.10 of the largest class 'a' (10)") for p in problems)


def test_near_pairs_use_the_hamming_distance_of_64_bit_hashes() -> None:
    from validation.image_data import _near_pairs

    hashes = np.array([2**63 | 1], dtype=np.uint64)
    earlier = np.array([1, 2**63], dtype=np.uint64)
    assert _near_pairs(hashes, earlier, 1) == [(0, 0, 1)]
    assert _near_pairs(hashes, earlier, 0) == []
