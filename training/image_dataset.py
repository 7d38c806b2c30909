"""The prepared image dataset format, both sides: `write_image_dataset` and `ImageDataset`.

Layout under a local folder or an object-store prefix (fsspec, like the token datasets)::

    <dataset>/IMAGES.json                    the manifest (`ImageManifest`), written last: without it the dataset
                                             is unfinished
    <dataset>/<split>-00000.images.u8        N x H x W x 3 uint8 pixels, raw C order (RGB, already resized)
    <dataset>/<split>-00000.targets.i32      labels: N int32 little-endian; captions: N x caption_len int32 token
                                             ids (EOS appended, padded with pad_id)
    <dataset>/tokenizer.json                 captions made with a BPE tokenizer: the tokenizer (TokenizerInfo.path)

Shards hold a fixed number of images (the last one of a split fewer); local ones are memory-mapped, remote ones
read with one ranged request per image. Pixels stay uint8: normalising them is the
model's first op, so the trainer and an exported image processor agree.

A dataset is untrusted input. Reading the manifest refuses split and shard names other than the ones the writer
makes (`<split>-NNNNN.images.u8` in the dataset folder, nothing else), counts that do not add up, sizes that do not
follow from the counts, a class list of the wrong length and ids outside the vocabulary. Opening a split checks
each file's size; the first read of a shard checks both files' sha256 and every target's range (labels below
num_classes, token ids below vocab_size). Each problem is an ImageDatasetError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from training.config import first_problem
from training.dataset import TokenizerInfo
from training.storage import (
    ControlFileError,
    StorageConfig,
    filesystem,
    is_local,
    join,
    local_path,
    read_control_file,
    sha256_file,
    write_bytes_atomic,
)
from training.untrusted import escape_untrusted

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "IMAGES.json"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_MAX_BYTES = 16 << 20
CHANNELS = 3
DEFAULT_SHARD_IMAGES = 4096
MAX_IMAGE_SIZE_PX = 4096
MAX_CAPTION_LEN = 65536
IMAGES_SUFFIX = ".images.u8"
TARGETS_SUFFIX = ".targets.i32"
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_TARGET_DTYPE = np.dtype("<i4")
_REBUILD = "rebuild the dataset (tdeploy prepare-data)"

ImageDatasetKind = Literal["labels", "captions"]


class ImageDatasetError(ValueError):
    """The image dataset is missing, unfinished, inconsistent, corrupt or not what the run expects.

    `file` names the dataset file at fault (relative to the dataset root) when there is one.
    """

    def __init__(self, url: str, problem: str, fix: str, file: str | None = None) -> None:
        super().__init__(f"{url}: {problem}; {fix}")
        self.url, self.problem, self.fix, self.file = url, problem, fix, file


def shard_names(split: str, number: int) -> tuple[str, str]:
    """The images and targets file names of shard `number` of `split` (the only names a manifest may use)."""
    stem = f"{split}-{number:05d}"
    return stem + IMAGES_SUFFIX, stem + TARGETS_SUFFIX


class ImageShardInfo(BaseModel):
    """One shard: its two files, image count, digests and total size."""

    model_config = ConfigDict(extra="forbid")

    images: str = Field(description="Pixel file name, relative to the dataset root (<split>-NNNNN.images.u8).")
    targets: str = Field(description="Target file name, relative to the dataset root (<split>-NNNNN.targets.i32).")
    count: int = Field(ge=1, description="Images in the shard.")
    images_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the pixel file.")
    targets_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the target file.")
    bytes: int = Field(ge=0, description="Size of both files together, bytes.")


class ImageSplitInfo(BaseModel):
    """Image count and shards of one split."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(ge=0, description="Images of the split (the sum of its shards' counts).")
    shards: list[ImageShardInfo] = Field(description="Shards in sample order.")


class ImageManifest(BaseModel):
    """IMAGES.json: the image dataset's table of contents and its commit marker."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = Field(default=FORMAT_VERSION, description="Format version of this layout.")
    kind: ImageDatasetKind = Field(description="labels: one class id per image; captions: token ids per image.")
    image_size: int = Field(ge=1, le=MAX_IMAGE_SIZE_PX, description="Side of every (square) image, px.")
    channels: Literal[3] = Field(default=CHANNELS, description="Colour channels (RGB).")
    num_classes: int | None = Field(default=None, ge=1, description="labels: number of classes; else None.")
    class_names: list[str] | None = Field(default=None, description="labels: class name of each id, when known.")
    caption_len: int | None = Field(
        default=None, ge=2, le=MAX_CAPTION_LEN, description="captions: token ids per caption (EOS and padding in)."
    )
    vocab_size: int | None = Field(default=None, ge=2, description="captions: the tokenizer's vocabulary size.")
    eos_id: int | None = Field(default=None, ge=0, description="captions: the EOS id ending each caption.")
    pad_id: int | None = Field(default=None, ge=0, description="captions: the id padding captions to caption_len.")
    tokenizer: TokenizerInfo | None = Field(default=None, description="captions: the tokenizer that made the ids.")
    splits: dict[str, ImageSplitInfo] = Field(description="Splits by name (train, val).")
    source_fingerprint: str = Field(description="Identity of the source and settings the dataset was made from.")
    created_unix_s: float = Field(ge=0, description="When the dataset was committed, Unix seconds.")

    @model_validator(mode="after")
    def _kind_fields(self) -> ImageManifest:
        if self.kind == "labels":
            if self.num_classes is None:
                raise ValueError("kind=labels needs num_classes")
            if self.class_names is not None and len(self.class_names) != self.num_classes:
                raise ValueError(f"class_names has {len(self.class_names)} names, num_classes={self.num_classes}")
            if self.caption_len is not None:
                raise ValueError("kind=labels has no caption_len")
        else:
            missing = [name for name in ("caption_len", "vocab_size", "eos_id", "pad_id", "tokenizer")
                       if getattr(self, name) is None]  # fmt: skip
            if missing:
                raise ValueError(f"kind=captions needs {', '.join(missing)}")
            assert self.vocab_size is not None and self.eos_id is not None and self.pad_id is not None
            for name in ("eos_id", "pad_id"):
                if getattr(self, name) >= self.vocab_size:
                    raise ValueError(f"{name}={getattr(self, name)} is outside the vocabulary [0, {self.vocab_size})")
        return self

    def curve_identity(self, train_split: str, val_split: str) -> dict[str, Any]:
        """What of this dataset determines a run's loss curve: the kind, image and target shapes, the tokenizer
        (captions) and both splits' shards (the quality baseline's key, tasks/acceptance/baselines.py)."""
        fields = ("kind", "image_size", "channels", "num_classes", "caption_len", "vocab_size", "eos_id", "pad_id")
        tokenizer = {"kind": self.tokenizer.kind, "sha256": self.tokenizer.sha256} if self.tokenizer else None
        return {name: getattr(self, name) for name in fields} | {
            "tokenizer": tokenizer, "train": self._split_identity(train_split), "val": self._split_identity(val_split)
        }  # fmt: skip

    def _split_identity(self, split: str) -> dict[str, Any] | None:
        info = self.splits.get(split)
        if info is None:
            return None
        return {"count": info.count,
                "shards": [[s.count, s.images_sha256, s.targets_sha256] for s in info.shards]}  # fmt: skip

    def checksums(self) -> dict[str, Any]:
        """The dataset's content by its checksums: every split's shards and the tokenizer (the ledger's dataset
        key)."""
        splits = {name: [[s.images_sha256, s.targets_sha256] for s in info.shards]
                  for name, info in sorted(self.splits.items())}  # fmt: skip
        return {"tokenizer": self.tokenizer.sha256 if self.tokenizer else None, "splits": splits}

    @property
    def target_width(self) -> int:
        """int32 values per image in a targets file (1 for labels, caption_len for captions)."""
        return 1 if self.kind == "labels" else int(self.caption_len or 0)

    @property
    def image_bytes(self) -> int:
        """Bytes of one image in a pixel file."""
        return self.image_size * self.image_size * self.channels

    @property
    def target_limit(self) -> int:
        """One more than the largest valid target (num_classes or vocab_size)."""
        return int(self.num_classes if self.kind == "labels" else self.vocab_size)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ImageBatch:
    """A batch: `images` uint8 (B, 3, H, W); `targets` int64, (B,) labels or (B, caption_len) token ids."""

    images: torch.Tensor
    targets: torch.Tensor


def manifest_problems(manifest: ImageManifest) -> list[tuple[str, str]]:
    """(file, problem) for every name, count or size in `manifest` that the writer would not have produced."""
    problems: list[tuple[str, str]] = []
    per_image = manifest.image_bytes + manifest.target_width * _TARGET_DTYPE.itemsize
    if manifest.tokenizer is not None and manifest.tokenizer.path not in (None, TOKENIZER_FILE):
        shown = escape_untrusted(manifest.tokenizer.path)
        problems.append((MANIFEST, f"tokenizer.path={shown!r}; the only tokenizer file is {TOKENIZER_FILE}"))
    if manifest.class_names is not None and len(set(manifest.class_names)) != len(manifest.class_names):
        problems.append((MANIFEST, "class_names repeats a name"))
    if manifest.class_names is not None and not all(name.isprintable() for name in manifest.class_names):
        problems.append((MANIFEST, "class_names holds a control character"))
    for name, split in manifest.splits.items():
        if not _SPLIT_NAME.match(name):
            problems.append((MANIFEST, f"split name {escape_untrusted(name)!r} is not [A-Za-z0-9_-]{{1,64}}"))
            continue
        total = 0
        for number, shard in enumerate(split.shards):
            where = f"splits.{name}.shards[{number}]"
            expected = shard_names(name, number)
            if (shard.images, shard.targets) != expected:
                got = escape_untrusted(f"{shard.images!r}, {shard.targets!r}")
                problems.append((MANIFEST, f"{where} names {got}; shard {number} of {name} is {list(expected)}"))
            if shard.bytes != shard.count * per_image:
                problems.append(
                    (MANIFEST, f"{where}.bytes={shard.bytes}, {shard.count} images make {shard.count * per_image}")
                )
            total += shard.count
        if total != split.count:
            problems.append((MANIFEST, f"splits.{name}.count={split.count}, its shards hold {total}"))
    return problems


def read_image_manifest(url: str, storage: StorageConfig | None = None) -> ImageManifest:
    """The manifest of a finished image dataset, or an ImageDatasetError that says what is wrong."""
    fs, root = filesystem(url, storage)
    try:
        raw = read_control_file(fs, join(root, MANIFEST), MANIFEST_MAX_BYTES)
    except ControlFileError as err:
        raise ImageDatasetError(url, f"{MANIFEST} {err.problem}", _REBUILD, file=MANIFEST) from err
    except FileNotFoundError as err:
        state = f"is unfinished (no {MANIFEST})" if fs.exists(root) else "does not exist"
        raise ImageDatasetError(url, f"the image dataset {state}", "build it first (tdeploy prepare-data)") from err
    version = _version_of(raw)
    if version != FORMAT_VERSION:
        raise ImageDatasetError(
            url, f"{MANIFEST} format_version={version!r}", f"this payload reads version {FORMAT_VERSION}; {_REBUILD}",
            file=MANIFEST,
        )  # fmt: skip
    try:
        manifest = ImageManifest.model_validate_json(raw)
    except ValidationError as err:
        raise ImageDatasetError(
            url, f"{MANIFEST} is not a valid image manifest ({first_problem(err, '<root>')})", _REBUILD, file=MANIFEST
        ) from err
    problems = manifest_problems(manifest)
    if problems:
        file, problem = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ImageDatasetError(url, f"{file} {problem}{more}", _REBUILD, file=file)
    return manifest


def _version_of(raw: bytes) -> Any:
    try:
        return json.loads(raw).get("format_version")
    except (ValueError, AttributeError, RecursionError):
        return None


def write_image_dataset(
    url: str,
    storage: StorageConfig | None,
    splits: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    kind: ImageDatasetKind,
    source_fingerprint: str,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    tokenizer: TokenizerInfo | None = None,
    tokenizer_json: str | None = None,
    shard_images: int = DEFAULT_SHARD_IMAGES,
) -> ImageManifest:
    """Write `splits` ({name: (images (N, S, S, 3) uint8, targets (N,) or (N, L) ints)}) as an image dataset at
    `url` and commit it: a manifest already there is removed first (the old dataset reads as unfinished from then
    on), the shards (and tokenizer.json) are written, and IMAGES.json last. Returns the manifest."""
    if shard_images < 1:
        raise ValueError(f"shard_images={shard_images}; use 1 or more")
    if not splits:
        raise ValueError("no splits to write; give at least one")
    first_images = next(iter(splits.values()))[0]
    image_size = int(first_images.shape[1]) if first_images.ndim == 4 else 0
    caption_len = None
    if kind == "captions":
        first_targets = next(iter(splits.values()))[1]
        caption_len = int(first_targets.shape[1]) if first_targets.ndim == 2 else 0
    limit = num_classes if kind == "labels" else vocab_size
    for name, (images, targets) in splits.items():
        if not _SPLIT_NAME.match(name):
            raise ValueError(f"split name {name!r} is not [A-Za-z0-9_-]{{1,64}}")
        shape = (images.shape[0], image_size, image_size, CHANNELS)
        if images.dtype != np.uint8 or images.shape != shape:
            raise ValueError(f"split {name}: images {images.dtype} {images.shape}; expected uint8 {shape}")
        want = (images.shape[0],) if kind == "labels" else (images.shape[0], caption_len)
        if targets.shape != want or not np.issubdtype(targets.dtype, np.integer):
            raise ValueError(f"split {name}: targets {targets.dtype} {targets.shape}; expected integers {want}")
        if limit is not None and targets.size and (targets.min() < 0 or targets.max() >= limit):
            raise ValueError(f"split {name}: targets span [{targets.min()}, {targets.max()}], outside [0, {limit})")
    fs, root = filesystem(url, storage)
    fs.makedirs(root, exist_ok=True)
    manifest_path = join(root, MANIFEST)
    if fs.exists(manifest_path):
        fs.rm(manifest_path)  # uncommit first
    if tokenizer_json is not None:
        write_bytes_atomic(fs, join(root, TOKENIZER_FILE), tokenizer_json.encode("utf-8"))
    infos: dict[str, ImageSplitInfo] = {}
    for name, (images, targets) in splits.items():
        shards = []
        for number, begin in enumerate(range(0, images.shape[0], shard_images)):
            pixels = np.ascontiguousarray(images[begin : begin + shard_images]).tobytes()
            values = np.ascontiguousarray(targets[begin : begin + shard_images], dtype=_TARGET_DTYPE).tobytes()
            image_file, target_file = shard_names(name, number)
            fs.pipe_file(join(root, image_file), pixels)
            fs.pipe_file(join(root, target_file), values)
            shards.append(
                ImageShardInfo(
                    images=image_file,
                    targets=target_file,
                    count=min(shard_images, images.shape[0] - begin),
                    images_sha256=hashlib.sha256(pixels).hexdigest(),
                    targets_sha256=hashlib.sha256(values).hexdigest(),
                    bytes=len(pixels) + len(values),
                )
            )
        infos[name] = ImageSplitInfo(count=int(images.shape[0]), shards=shards)
    manifest = ImageManifest(
        kind=kind,
        image_size=image_size,
        num_classes=num_classes,
        class_names=list(class_names) if class_names is not None else None,
        caption_len=caption_len,
        vocab_size=vocab_size,
        eos_id=eos_id,
        pad_id=pad_id,
        tokenizer=tokenizer,
        splits=infos,
        source_fingerprint=source_fingerprint,
        created_unix_s=time.time(),
    )
    problems = manifest_problems(manifest)
    assert not problems, problems
    write_bytes_atomic(fs, manifest_path, manifest.model_dump_json(indent=2).encode())
    return manifest


class _ShardReader:
    """Random access to one shard's images and targets; both files are checked on first read."""

    def __init__(self, dataset: ImageDataset, info: ImageShardInfo) -> None:
        self.dataset, self.info = dataset, info
        self.images_path = join(dataset.root, info.images)
        self.targets_path = join(dataset.root, info.targets)
        self._pixels: np.ndarray | None = None
        self._targets: np.ndarray | None = None
        self._checked = False

    def _load(self) -> tuple[np.ndarray | None, np.ndarray]:
        """(pixels, targets) after checking both files once: pixels memory-mapped (local) or None (remote)."""
        if not self._checked:
            ds, info, manifest = self.dataset, self.info, self.dataset.manifest
            for rel, path, digest in ((info.images, self.images_path, info.images_sha256),
                                      (info.targets, self.targets_path, info.targets_sha256)):  # fmt: skip
                if sha256_file(ds.fs, path) != digest:
                    raise ImageDatasetError(
                        ds.url, f"{rel}: sha256 differs from {MANIFEST} (the file changed after it was written)",
                        f"{_REBUILD}; do not edit a prepared dataset", file=rel,
                    )  # fmt: skip
            side = manifest.image_size
            pixel_shape = (info.count, side, side, manifest.channels)
            target_shape = (info.count,) if manifest.kind == "labels" else (info.count, manifest.target_width)
            # local: a memory map; remote: None, each read fetches its images' byte ranges
            pixels = (
                np.asarray(np.memmap(self.images_path, dtype=np.uint8, mode="r", shape=pixel_shape))
                if ds.local
                else None
            )
            targets = np.frombuffer(ds.fs.cat_file(self.targets_path), dtype=_TARGET_DTYPE).reshape(target_shape)
            limit = manifest.target_limit
            bad = np.flatnonzero(((targets < 0) | (targets >= limit)).reshape(info.count, -1).any(axis=1))
            if bad.size:
                value = targets[bad[0]]
                what = "label" if manifest.kind == "labels" else "token id"
                bound = "num_classes" if manifest.kind == "labels" else "vocab_size"
                raise ImageDatasetError(
                    ds.url,
                    f"{info.targets}: image {int(bad[0])} has {what} {value.tolist()} outside [0, {bound}={limit}) "
                    f"({bad.size} such images)",
                    _REBUILD,
                    file=info.targets,
                )
            self._pixels, self._targets, self._checked = pixels, targets, True
        assert self._targets is not None
        return self._pixels, self._targets

    def read(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pixels, targets = self._load()
        if pixels is not None:
            return pixels[local], targets[local]
        size = self.dataset.manifest.image_bytes
        side, channels = self.dataset.manifest.image_size, self.dataset.manifest.channels
        fetched = [self.dataset.fs.cat_file(self.images_path, start=int(i) * size, end=(int(i) + 1) * size)
                   for i in local]  # fmt: skip
        images = np.frombuffer(b"".join(fetched), dtype=np.uint8).reshape(len(local), side, side, channels)
        return images, targets[local]


class ImageDataset:
    """The images and targets of one split of a prepared image dataset, addressable by index.

    Opening reads and checks the manifest and each file's size; the first read of a shard checks its digests and
    target range. `expect_kind` (labels or captions) refuses a dataset of the other kind.
    """

    def __init__(
        self, url: str, split: str, storage: StorageConfig | None = None, *, expect_kind: str | None = None
    ) -> None:
        self.url, self.split = url, split
        self.manifest = read_image_manifest(url, storage)
        if expect_kind is not None and self.manifest.kind != expect_kind:
            raise ImageDatasetError(
                url,
                f"{MANIFEST} kind={self.manifest.kind}, the run needs kind={expect_kind}",
                "point the run at a dataset prepared for this model kind (labels for vit, captions for vlm)",
                file=MANIFEST,
            )
        if split not in self.manifest.splits:
            raise ImageDatasetError(url, f"no split {split!r}", f"available: {sorted(self.manifest.splits)}")
        self.fs, self.root = filesystem(url, storage)
        self.local = is_local(url)
        if self.local:
            self.root = local_path(self.root)
        info = self.manifest.splits[split]
        target_bytes = self.manifest.target_width * _TARGET_DTYPE.itemsize
        for shard in info.shards:
            for rel, want in ((shard.images, shard.count * self.manifest.image_bytes),
                              (shard.targets, shard.count * target_bytes)):  # fmt: skip
                self._check_size(rel, want)
        self._readers = [_ShardReader(self, shard) for shard in info.shards]
        self._starts = np.cumsum([0] + [shard.count for shard in info.shards]).astype(np.int64)
        if len(self) == 0:
            raise ImageDatasetError(url, f"split {split!r} has no images", "prepare the dataset with more images")

    def _check_size(self, rel: str, want: int) -> None:
        try:
            info = self.fs.info(join(self.root, rel))
        except FileNotFoundError as err:
            raise ImageDatasetError(self.url, f"{rel} is missing", _REBUILD, file=rel) from err
        if info.get("type") != "file" or info.get("size") != want:
            raise ImageDatasetError(
                self.url, f"{rel} holds {info.get('size')} bytes ({info.get('type')}), {MANIFEST} says {want}",
                _REBUILD, file=rel,
            )  # fmt: skip

    def __len__(self) -> int:
        return int(self._starts[-1])

    def batch(self, indices: Sequence[int] | np.ndarray) -> ImageBatch:
        """Images (B, 3, H, W) uint8 and targets int64 of the samples at `indices` (in that order)."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)}): {index.min()}..{index.max()}")
        manifest = self.manifest
        side = manifest.image_size
        pixels = np.empty((index.size, side, side, manifest.channels), dtype=np.uint8)
        targets = np.empty((index.size, manifest.target_width), dtype=np.int64)
        shard_of = np.searchsorted(self._starts, index, side="right") - 1
        for shard in np.unique(shard_of):
            where = np.flatnonzero(shard_of == shard)
            got_pixels, got_targets = self._readers[shard].read(index[where] - self._starts[shard])
            pixels[where] = got_pixels
            targets[where] = got_targets.reshape(where.size, -1)
        images = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
        out = torch.from_numpy(targets)
        return ImageBatch(images=images, targets=out[:, 0].contiguous() if manifest.kind == "labels" else out)


def verify_image_dataset(url: str, storage: StorageConfig | None = None, digests: bool = False) -> list[str]:
    """Every problem of the dataset's files against its manifest: sizes, and with `digests` also each file's
    sha256 and each target's range (the checks a first read makes). Empty when the dataset is whole."""
    try:
        manifest = read_image_manifest(url, storage)
    except ImageDatasetError as err:
        return [str(err)]
    problems = []
    for split in manifest.splits:
        try:
            dataset = ImageDataset(url, split, storage)
            for reader in dataset._readers if digests else ():
                reader._load()
        except ImageDatasetError as err:
            problems.append(str(err))
    return problems
