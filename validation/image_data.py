"""Great Expectations suite that gates an image dataset before it is written: what goes wrong with image data.

The data step (tasks/prepare/images.py) decodes every source image once and hands one `ImageRow` per image here;
`run_image_suite` turns the rows into three tables and runs one suite over each, on the same `SuiteRunner` (and
so the same Data Docs and offline report) as the text suites:

- `images`, one row per source image: undecodable files, images smaller than `min_side_px`, modes that cannot
  become 8-bit RGB without loss (16-bit and float: "I", "I;16", "F"), labels outside the class list, captions
  longer than `max_caption_tokens`, exact duplicates (sha256 of the decoded pixels) and perceptual
  near-duplicates (64-bit pHash within `near_dup_max_distance` bits) across splits, exact duplicates within a
  split (a share), and the share of images that were not RGB.
- `image_classes`, one row per class (labels): each class's images against the largest class's.
- `image_splits`, one row per split: the held-out split's size and the total.

Channels: every image is stored as 8-bit RGB. Grayscale (L, LA, 1), palette (P, PA), RGBA (alpha dropped) and
CMYK/YCbCr/LAB/HSV sources are converted and counted (`converted`); more than `max_converted_fraction` of them
fails (a colour dataset that is mostly grayscale is likely the wrong data; raise the bound for a grayscale one).
High-bit-depth and float modes are refused image by image: converting them clips values.

Each defect is also a `DataProblem` that names the file (and for duplicates the other file), the value and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from training.config import StrictModel
from validation.data import DataProblem, FailedExpectation, SuiteRunner

LOSSY_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
"""Pillow modes with more than 8 bits per channel: converting them to 8-bit RGB clips values."""
MAX_PROBLEMS = 200
"""Defects listed one by one; the rest are counted (the report's tables have every row)."""
_FIELD = "data.prepare.images"


class ImageExpectations(StrictModel):
    """Thresholds of the image suite (the fields of data.prepare.images that judge the images)."""

    min_side_px: int = Field(
        default=16, ge=1, le=65536, description="Images whose shorter side is smaller than this many px are refused."
    )
    near_dup_max_distance: int | None = Field(
        default=4,
        ge=0,
        le=32,
        description=(
            "Two images in different splits whose 64-bit perceptual hashes (pHash of the prepared pixels) differ "
            "in at most this many bits are refused as near-duplicates; None = off."
        ),
    )
    min_class_ratio: float = Field(
        default=0.2,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="labels: each class must have at least this share of the largest class's images (all splits).",
    )
    max_converted_fraction: float = Field(
        default=0.05,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description=(
            "Largest share of images that were not RGB in the source (grayscale, palette, RGBA, CMYK) and were "
            "converted to RGB."
        ),
    )
    max_duplicate_fraction: float = Field(
        default=0.01,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Largest share of images that repeat an earlier image of the same split pixel for pixel "
        "(a duplicate across splits is always refused).",
    )
    min_images: int = Field(default=10, ge=1, le=10**12, description="Fewest images the dataset must have.")
    min_val_images: int = Field(default=1, ge=0, le=10**12, description="Fewest images in the held-out split.")


@dataclass
class ImageRow:
    """One source image as the data step decoded it (the per-image table's row before the cross-image flags)."""

    file: str
    """Where the image came from: a path relative to the source, a tar member, or a dataset row."""
    split: str
    decodable: bool
    error: str | None = None
    width: int | None = None
    height: int | None = None
    mode: str | None = None
    label: int | None = None
    """labels: the class id (-1: a class folder outside the class list)."""
    label_name: str | None = None
    caption_tokens: int | None = None
    sha256: str | None = None
    """sha256 of the decoded source pixels (mode, size and bytes)."""
    phash: int | None = None
    """64-bit pHash of the prepared pixels."""


@dataclass
class ImageSuiteResult:
    """The image suite's outcome: expectations evaluated and failed, and each defect with its file and fix."""

    evaluated: int
    failed: list[FailedExpectation]
    problems: list[DataProblem]
    tables: dict[str, Any]

    @property
    def success(self) -> bool:
        """Every expectation held and no defect was found."""
        return not self.failed and not self.problems


def phash64(pixels: np.ndarray) -> int:
    """The 64-bit pHash (imagehash's DCT hash) of an (H, W, 3) uint8 image, as an int."""
    import imagehash
    from PIL import Image

    bits = imagehash.phash(Image.fromarray(pixels)).hash.reshape(-1)
    return int(np.packbits(bits.astype(np.uint8)).view(">u8")[0])


def _near_pairs(hashes: np.ndarray, earlier: np.ndarray, max_distance: int) -> list[tuple[int, int, int]]:
    """(i, j, distance) for each hash i of `hashes` whose nearest hash j of `earlier` is within max_distance."""
    pairs = []
    for i, value in enumerate(hashes):
        distance = np.bitwise_count(np.bitwise_xor(earlier, value))
        j = int(np.argmin(distance))
        if distance[j] <= max_distance:
            pairs.append((i, j, int(distance[j])))
    return pairs


def image_frame(
    rows: Sequence[ImageRow], kind: Literal["labels", "captions"], num_classes: int | None,
    limits: ImageExpectations,
) -> tuple[Any, list[tuple[int, int, int]]]:  # fmt: skip
    """The per-image table with its cross-image flags, and the near-duplicate pairs (row, earlier row, bits)."""
    import pandas as pd

    frame = pd.DataFrame([row.__dict__ for row in rows])
    frame["min_side"] = frame[["width", "height"]].min(axis=1)
    frame["mode_ok"] = ~frame["mode"].isin(LOSSY_MODES)
    frame["converted"] = frame["decodable"] & (frame["mode"] != "RGB")
    if kind == "labels":
        in_range = frame["label"].between(0, (num_classes or 0) - 1)
        frame["label_in_range"] = in_range | ~frame["decodable"]
    frame["duplicate_in_split"] = frame["sha256"].notna() & frame.duplicated(["sha256", "split"])
    first_split = frame.groupby("sha256")["split"].transform("first")
    frame["duplicate_across_splits"] = frame["sha256"].notna() & (frame["split"] != first_split)
    frame["duplicate_of"] = None
    firsts = frame[frame["sha256"].notna()].drop_duplicates("sha256").set_index("sha256")["file"]
    across = frame["duplicate_across_splits"]
    frame.loc[across, "duplicate_of"] = frame.loc[across, "sha256"].map(firsts)
    frame["near_duplicate_across_splits"] = False
    frame["near_duplicate_of"] = None
    pairs: list[tuple[int, int, int]] = []
    if limits.near_dup_max_distance is not None:
        hashed = frame[frame["phash"].notna() & ~frame["duplicate_across_splits"]]
        splits = sorted(hashed["split"].unique())
        for number, split in enumerate(splits[1:], start=1):
            later = hashed[hashed["split"] == split]
            earlier = hashed[hashed["split"].isin(splits[:number])]
            if not len(earlier) or not len(later):
                continue
            found = _near_pairs(
                later["phash"].astype("uint64").to_numpy(), earlier["phash"].astype("uint64").to_numpy(),
                limits.near_dup_max_distance,
            )  # fmt: skip
            for i, j, bits in found:
                row, other = int(later.index[i]), int(earlier.index[j])
                pairs.append((row, other, bits))
                frame.loc[row, "near_duplicate_across_splits"] = True
                frame.loc[row, "near_duplicate_of"] = frame.loc[other, "file"]
    return frame, pairs


def class_frame(frame: Any, num_classes: int, class_names: Sequence[str] | None) -> Any:
    """One row per class: its images (decodable, all splits) and their share of the largest class's."""
    import pandas as pd

    labels = frame.loc[frame["decodable"] & frame["label"].between(0, num_classes - 1), "label"].astype(int)
    counts = np.bincount(labels.to_numpy(), minlength=num_classes)[:num_classes]
    largest = max(int(counts.max()), 1)
    names = list(class_names) if class_names is not None else [str(c) for c in range(num_classes)]
    return pd.DataFrame(
        {"class_id": range(num_classes), "class_name": names, "images": counts, "ratio_to_largest": counts / largest}
    )


def split_frame(frame: Any) -> Any:
    """One row per split: its images."""
    counts = frame.groupby("split").size()
    import pandas as pd

    return pd.DataFrame({"split": counts.index.astype(str), "images": counts.to_numpy()})


def image_expectations(
    gx: Any, kind: str, num_classes: int | None, max_caption_tokens: int | None, limits: ImageExpectations,
    val_split: str = "val",
) -> dict[str, list]:  # fmt: skip
    """The suite: one list of expectations per table (images, image_classes, image_splits)."""
    from great_expectations.expectations.row_conditions import Column

    e = gx.expectations
    images = [
        e.ExpectColumnValuesToBeInSet(column="decodable", value_set=[True]),
        e.ExpectColumnValuesToBeBetween(column="min_side", min_value=limits.min_side_px),
        e.ExpectColumnValuesToBeInSet(column="mode_ok", value_set=[True]),
        e.ExpectColumnMeanToBeBetween(column="converted", max_value=limits.max_converted_fraction),
        e.ExpectColumnValuesToBeInSet(column="duplicate_across_splits", value_set=[False]),
        e.ExpectColumnValuesToBeInSet(column="near_duplicate_across_splits", value_set=[False]),
        e.ExpectColumnMeanToBeBetween(column="duplicate_in_split", max_value=limits.max_duplicate_fraction),
    ]
    if kind == "labels":
        images.append(e.ExpectColumnValuesToBeInSet(column="label_in_range", value_set=[True]))
    else:
        images.append(e.ExpectColumnValuesToBeBetween(column="caption_tokens", max_value=max_caption_tokens))
    suites: dict[str, list] = {"images": images}
    if kind == "labels":
        suites["image_classes"] = [
            e.ExpectColumnValuesToBeBetween(column="ratio_to_largest", min_value=limits.min_class_ratio)
        ]
    suites["image_splits"] = [
        e.ExpectColumnSumToBeBetween(column="images", min_value=limits.min_images),
        e.ExpectColumnValuesToBeBetween(
            column="images", min_value=limits.min_val_images, row_condition=Column("split") == val_split
        ),
    ]
    return suites


def _row_problems(row: dict[str, Any], kind: str, num_classes: int | None, class_names: Sequence[str] | None,
                  max_caption_tokens: int | None, limits: ImageExpectations) -> list[DataProblem]:  # fmt: skip
    """The defects of one image, each naming its file, the value and the fix."""
    file = row["file"]
    if not row["decodable"]:
        return [DataProblem(file, f"{file}: not a decodable image ({row['error']})", "remove or replace the file")]
    found = []
    if row["min_side"] < limits.min_side_px:
        found.append(DataProblem(
            file, f"{file}: {int(row['width'])}x{int(row['height'])} px, its shorter side is below min_side_px="
            f"{limits.min_side_px}", f"remove the image or lower {_FIELD}.min_side_px",
        ))  # fmt: skip
    if not row["mode_ok"]:
        found.append(DataProblem(
            file, f"{file}: mode {row['mode']} (more than 8 bits per channel) cannot become 8-bit RGB without "
            "clipping", "convert it to 8-bit RGB yourself (scaling its range) or remove it",
        ))  # fmt: skip
    if kind == "labels" and not row["label_in_range"]:
        if row["label"] == -1:
            problem = f"{file}: class {row['label_name']!r} is not one of class_names {list(class_names or [])}"
            fix = f"move the image into one of the class folders or add its class to {_FIELD}.class_names"
        else:
            shown = None if row["label"] is None or row["label"] != row["label"] else int(row["label"])  # NaN: none
            problem = f"{file}: label={shown} is outside [0, num_classes={num_classes})"
            fix = f"correct the label, or set {_FIELD}.num_classes / class_names to the dataset's classes"
        found.append(DataProblem(file, problem, fix))
    if kind == "captions" and max_caption_tokens is not None and row["caption_tokens"] > max_caption_tokens:
        found.append(DataProblem(
            file, f"{file}: caption of {row['caption_tokens']} tokens, more than max_caption_tokens="
            f"{max_caption_tokens}", f"shorten the caption or raise {_FIELD}.max_caption_tokens",
        ))  # fmt: skip
    if row["duplicate_across_splits"]:
        found.append(DataProblem(
            file, f"{file} ({row['split']}) has the same pixels as {row['duplicate_of']} (another split)",
            "remove one of the two: a duplicate across splits leaks held-out images into training",
        ))  # fmt: skip
    return found


def image_problems(frame: Any, pairs: list[tuple[int, int, int]], classes: Any, splits: Any, kind: str,
                   num_classes: int | None, class_names: Sequence[str] | None, max_caption_tokens: int | None,
                   limits: ImageExpectations, val_split: str = "val") -> list[DataProblem]:  # fmt: skip
    """Every defect the tables show, each naming its file(s), the value and the fix."""
    problems: list[DataProblem] = []
    for row in frame.to_dict("records"):
        problems += _row_problems(row, kind, num_classes, class_names, max_caption_tokens, limits)
    for row, other, bits in pairs:
        a, b = frame.loc[row], frame.loc[other]
        problems.append(DataProblem(
            a["file"], f"{a['file']} ({a['split']}) is a near-duplicate of {b['file']} ({b['split']}): pHash "
            f"{bits} bits apart, near_dup_max_distance={limits.near_dup_max_distance}",
            f"remove one of the two, or lower {_FIELD}.near_dup_max_distance (None turns the check off)",
        ))  # fmt: skip
    decodable = frame[frame["decodable"]]
    share = float(decodable["converted"].mean()) if len(decodable) else 0.0
    if share > limits.max_converted_fraction:
        modes = decodable.loc[decodable["converted"], "mode"].value_counts().to_dict()
        examples = decodable.loc[decodable["converted"], "file"].head(3).tolist()
        problems.append(DataProblem(
            None, f"{share:.1%} of the images were not RGB ({modes}, e.g. {examples}) and were converted, more "
            f"than max_converted_fraction={limits.max_converted_fraction}",
            f"check that these are the images meant; for a grayscale dataset raise {_FIELD}.max_converted_fraction",
        ))  # fmt: skip
    dup_share = float(frame["duplicate_in_split"].mean()) if len(frame) else 0.0
    if dup_share > limits.max_duplicate_fraction:
        examples = frame.loc[frame["duplicate_in_split"], "file"].head(3).tolist()
        problems.append(DataProblem(
            None, f"{dup_share:.1%} of the images repeat an earlier image of their split (e.g. {examples}), more "
            f"than max_duplicate_fraction={limits.max_duplicate_fraction}",
            f"remove the copies or raise {_FIELD}.max_duplicate_fraction",
        ))  # fmt: skip
    if classes is not None:
        largest = classes.loc[classes["images"].idxmax()]
        for row in classes[classes["ratio_to_largest"] < limits.min_class_ratio].to_dict("records"):
            problems.append(DataProblem(
                None, f"class {row['class_name']!r}: {row['images']} images, {row['ratio_to_largest']:.2f} of the "
                f"largest class {largest['class_name']!r} ({largest['images']}), below min_class_ratio="
                f"{limits.min_class_ratio}", f"add images of that class or lower {_FIELD}.min_class_ratio",
            ))  # fmt: skip
    total = int(splits["images"].sum())
    if total < limits.min_images:
        problems.append(DataProblem(None, f"{total} images, fewer than min_images={limits.min_images}",
                                    "add images to the source"))  # fmt: skip
    held_out = int(splits.loc[splits["split"] == val_split, "images"].sum())
    if held_out < limits.min_val_images:
        problems.append(DataProblem(
            None, f"split {val_split}: {held_out} images, fewer than min_val_images={limits.min_val_images}",
            f"raise {_FIELD}.val_fraction or add images",
        ))  # fmt: skip
    return problems


def run_image_suite(
    runner: SuiteRunner,
    rows: Sequence[ImageRow],
    limits: ImageExpectations,
    *,
    kind: Literal["labels", "captions"],
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    max_caption_tokens: int | None = None,
    val_split: str = "val",
) -> ImageSuiteResult:
    """The image suite over the decoded images: the expectations' outcome and each defect with its file and fix."""
    frame, pairs = image_frame(rows, kind, num_classes, limits)
    classes = class_frame(frame, num_classes, class_names) if kind == "labels" and num_classes else None
    splits = split_frame(frame)
    tables = {"images": frame, "image_classes": classes, "image_splits": splits}
    suites = image_expectations(runner.gx, kind, num_classes, max_caption_tokens, limits, val_split)
    evaluated, failed = 0, []
    for name, expectations in suites.items():
        table = tables[name]
        if name == "images":  # GE's renderers want plain columns: the hashes are kept out of its table
            table = table.drop(columns=["phash", "sha256", "error"])
        n, bad = runner.run(name, table, expectations)
        evaluated += n
        failed.extend(bad)
    problems = image_problems(frame, pairs, classes, splits, kind, num_classes, class_names, max_caption_tokens,
                              limits, val_split)  # fmt: skip
    return ImageSuiteResult(evaluated, failed, problems, tables)
