"""The data step for images (data.prepare.images): read, decode, check, split and shard an image dataset.

Sources (`kind`): an ImageFolder tree (`<class>/<image>`, or `train/<class>/<image>` and `val/<class>/<image>`
whose split is kept), a Hugging Face dataset saved with save_to_disk (an image column and a label or caption
column; every split's rows are read), or WebDataset tar shards (`<key>.png|jpg|jpeg|webp` with `<key>.cls` or
`<key>.txt`, read with the standard library's tarfile).

Every image is decoded once with Pillow on `workers` threads (Pillow releases the GIL while it decodes and
resizes): EXIF orientation applied, converted to 8-bit RGB, the centred square cropped and resized to
`image_size` (bicubic). The images are split (seeded; stratified by class for labels), captions are tokenized
with data.prepare.tokenizer (EOS appended, padded with EOS to max_caption_tokens + 1 ids), and the image suite
(validation/image_data.py) runs over every image before anything is written: a dataset with any defect is never
written, the report naming each one is published under the dataset's folder (which has no IMAGES.json, so it
reads as unfinished) and the step fails. A clean dataset is written by training/image_dataset.py, IMAGES.json
last.

The dataset goes to `<output_url>/<key>/`, the key hashing each input file's identity (fsspec's checksum: size and
modification time or ETag), every setting of data.prepare.images (thresholds included: a reused dataset's verdict
is the one its thresholds gave), the tokenizer for captions and the versions of the code behind the pixels;
re-running with the same key reuses the finished dataset after checking its files' sizes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import tarfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from tasks.errors import NoSpaceError, UserError, is_connection_error
from tasks.prepare.config import ImagePrepareConfig, PrepareConfig
from tasks.prepare.encoding import encode_threads
from tasks.prepare.pipeline import (
    DATA_DOCS_DIR,
    PREPARE_FILE,
    REPORT_DIR,
    VALIDATION_FILE,
    DataValidationError,
    PrepareResult,
    Progress,
    unreachable_storage_is_transient,
)
from tasks.prepare.tokenizer import TextTokenizer, load_tokenizer, train_bpe
from training.image_dataset import (
    FORMAT_VERSION,
    MANIFEST,
    ImageManifest,
    read_image_manifest,
    verify_image_dataset,
    write_image_dataset,
)
from training.storage import (
    StorageConfig,
    filesystem,
    free_bytes,
    is_no_space,
    join,
    read_control_file,
    write_bytes_atomic,
)
from training.untrusted import escape_untrusted
from validation.data import DataProblem
from validation.image_data import LOSSY_MODES, ImageRow, phash64

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
WEBDATASET_IMAGES = ("png", "jpg", "jpeg", "webp")
SPLITS = ("train", "val")
"""The splits written (the names data.train_split and data.val_split default to, as for text)."""
PIPELINE_VERSION = 1
"""Bump when decoding, cropping, resizing or splitting code changes the pixels: every dataset gets a new key."""
REJECTED_MANIFEST = "IMAGES.rejected.json"
_FIELD = "data.prepare.images"


@dataclass
class SourceImage:
    """One image of the source: its name in messages, how to get its bytes, and its label or caption."""

    name: str
    read: Callable[[], bytes]
    label: int | None = None
    label_name: str | None = None
    caption: str | None = None
    split: str | None = None
    """The split the source gives (imagefolder train/ and val/), or None (the step splits)."""


@dataclass
class Source:
    """What a source holds: its images, its classes (labels) and the identity of its files."""

    images: list[SourceImage]
    class_names: list[str] | None
    num_classes: int | None
    fingerprint: list[str]


@dataclass
class Decoded:
    """One image decoded: its table row and, where it could be stored, its prepared pixels."""

    row: ImageRow
    pixels: np.ndarray | None = None
    caption_ids: np.ndarray | None = None


@dataclass
class _Prepared:
    decoded: list[Decoded]
    split_of: list[str]
    tokenizer: TextTokenizer | None
    seconds: dict[str, float] = field(default_factory=dict)


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _reader(fs: Any, path: str, root: str) -> Callable[[], bytes]:
    """The file's bytes; a local file that a symbolic link (of the file or a folder) leads outside `root` is
    refused: it could lead outside the folders the spec may read."""

    def read() -> bytes:
        if isinstance(fs, LocalFileSystem):
            real, base = os.path.realpath(path), os.path.realpath(root)
            if os.path.islink(path) or not real.startswith(base.rstrip("/") + "/"):
                raise ValueError("a symbolic link; the data step reads regular files only (copy the image in)")
        return fs.cat_file(path)

    return read


def imagefolder_source(cfg: ImagePrepareConfig, storage: StorageConfig) -> Source:
    """`<class>/<image>` (or train/ and val/ of them) under cfg.path; files of other extensions are skipped."""
    fs, root = filesystem(cfg.path, storage)
    if not fs.isdir(root):
        raise UserError(f"{_FIELD}.path={cfg.path}: no such folder", "point it at the folder of class folders")
    files = sorted(path for path in fs.find(root) if _is_image(path))
    rels = [posixpath.relpath(path, root.rstrip("/") or "/") for path in files]
    tops = {rel.split("/", 1)[0] for rel in rels if "/" in rel}
    given_splits = tops == set(SPLITS)
    depth = 2 if given_splits else 1
    found: list[str] = sorted({rel.split("/")[depth - 1] for rel in rels if rel.count("/") >= depth})
    odd = [name for name in found if not name.isprintable()]
    if odd and cfg.class_names is None:
        raise UserError(f"{_FIELD}.path={cfg.path}: class folder {escape_untrusted(odd[0])!r} has a control character",
                        "rename the folder (a class name is shown in reports and written to IMAGES.json)")  # fmt: skip
    class_names = cfg.class_names or found
    ids = {name: number for number, name in enumerate(class_names)}
    images, skipped = [], 0
    for path, rel in zip(files, rels, strict=True):
        parts = rel.split("/")
        if len(parts) <= depth:  # an image beside the class folders has no class
            skipped += 1
            continue
        name = parts[depth - 1]
        images.append(SourceImage(escape_untrusted(rel, None), _reader(fs, path, root), ids.get(name, -1), name,
                                  split=parts[0] if given_splits else None))  # fmt: skip
    if skipped:
        log.warning("%s: %d images outside any class folder were skipped", cfg.path, skipped)
    if not images:
        raise UserError(f"{_FIELD}.path={cfg.path}: no images in class folders (<class>/<image>.png|jpg|...)",
                        "point it at an ImageFolder tree")  # fmt: skip
    fingerprint = [f"{rel}:{fs.checksum(path)}" for path, rel in zip(files, rels, strict=True)]
    return Source(images, list(class_names), len(class_names), fingerprint)


def hf_source(cfg: ImagePrepareConfig, storage: StorageConfig) -> Source:
    """The rows of every split of a save_to_disk dataset: image column, and label or caption column."""
    import datasets

    from tasks.prepare.hf import _load, inspect_hf  # the package's one reader of datasets on disk

    fs, path = filesystem(cfg.path, storage)
    fingerprint = inspect_hf(cfg.path, storage).fingerprint
    splits = _load(cfg.path, path)
    target = cfg.label_column or cfg.caption_column
    first = next(iter(splits.values()))
    for column in (cfg.image_column, target):
        if column not in first.column_names:
            raise UserError(f"{_FIELD}: {cfg.path} has no column {column!r} (it has {first.column_names})",
                            f"set {_FIELD}.image_column / label_column / caption_column to its columns")  # fmt: skip
    feature = first.features.get(cfg.label_column) if cfg.label_column else None
    feature_names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    class_names = cfg.class_names or feature_names
    num_classes = cfg.num_classes or (len(class_names) if class_names else None)
    if cfg.label_column and num_classes is None:
        raise UserError(f"{_FIELD}.label_column={cfg.label_column}: a plain integer column, no class list",
                        f"set {_FIELD}.num_classes (or class_names) so labels can be checked")  # fmt: skip
    images = []
    for split, ds in splits.items():
        if isinstance(ds.features.get(cfg.image_column), datasets.Image):
            ds = ds.cast_column(cfg.image_column, datasets.Image(decode=False))
        for number, row in enumerate(ds):
            value = row[cfg.image_column]
            name = f"{split}[{number}]"
            label = row[cfg.label_column] if cfg.label_column else None
            named = class_names and isinstance(label, int) and 0 <= label < len(class_names)
            images.append(SourceImage(
                name, _hf_bytes(value, name), label, class_names[label] if named else None,
                row[cfg.caption_column] if cfg.caption_column else None,
            ))  # fmt: skip
    return Source(images, class_names, num_classes, fingerprint)


def _hf_bytes(value: Any, name: str) -> Callable[[], bytes]:
    def read() -> bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, dict) and value.get("bytes") is not None:
            return bytes(value["bytes"])
        if isinstance(value, dict) and value.get("path"):
            with open(value["path"], "rb") as handle:
                return handle.read()
        raise ValueError(f"{name}: the image cell holds neither bytes nor a path")

    return read


def webdataset_source(cfg: ImagePrepareConfig, storage: StorageConfig) -> Source:
    """The samples of tar shards (a file, a folder of .tar files or a glob), grouped by key."""
    fs, path = filesystem(cfg.path, storage)
    if any(c in path for c in "*?["):
        shards = sorted(fs.glob(path))
    elif fs.isdir(path):
        shards = sorted(p for p in fs.find(path) if p.endswith(".tar"))
    else:
        shards = [path] if fs.exists(path) else []
    if not shards:
        raise UserError(f"{_FIELD}.path={cfg.path}: no .tar shards there", "point it at WebDataset tar files")
    target = cfg.label_column or cfg.caption_column
    num_classes = cfg.num_classes or (len(cfg.class_names) if cfg.class_names else None)
    if cfg.label_column and num_classes is None:
        raise UserError(f"{_FIELD}: WebDataset labels without a class list",
                        f"set {_FIELD}.num_classes or class_names")  # fmt: skip
    images: list[SourceImage] = []
    for shard in shards:
        tar_name = posixpath.basename(shard)
        with fs.open(shard, "rb") as handle, tarfile.open(fileobj=handle, mode="r|*") as tar:
            for key, members in _tar_samples(tar):
                name = escape_untrusted(f"{tar_name}:{key}", None)  # names reach messages and reports
                images.append(_webdataset_image(cfg, name, members, target, num_classes))
    fingerprint = [f"{shard}:{fs.checksum(shard)}" for shard in shards]
    return Source(images, cfg.class_names, num_classes, fingerprint)


def _tar_samples(tar: tarfile.TarFile) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) of consecutive members sharing a key (WebDataset: the name up to the first dot
    of its last component)."""
    key, members = None, {}
    for member in tar:
        if not member.isfile():
            continue
        folder, base = posixpath.split(member.name)
        stem, _, ext = base.partition(".")
        sample = posixpath.join(folder, stem)
        if sample != key and key is not None:
            yield key, members
            members = {}
        key = sample
        handle = tar.extractfile(member)
        members[ext.lower()] = handle.read() if handle is not None else b""
    if key is not None:
        yield key, members


def _webdataset_image(cfg: ImagePrepareConfig, name: str, members: dict[str, bytes], target: str | None,
                      num_classes: int | None) -> SourceImage:  # fmt: skip
    ext = next((e for e in WEBDATASET_IMAGES if e in members), None)
    data = members.get(ext, b"") if ext else b""
    image_name = f"{name}.{ext}" if ext else f"{name} (no {'/'.join(WEBDATASET_IMAGES)} member)"
    text = members.get(target or "", b"").decode("utf-8", errors="replace").strip()
    if cfg.label_column:
        label = int(text) if text.lstrip("-").isdigit() else None
        names = cfg.class_names
        label_name = names[label] if names and label is not None and 0 <= label < len(names) else text or None
        return SourceImage(image_name, lambda: data, label, label_name)
    return SourceImage(image_name, lambda: data, caption=text)


def read_source(cfg: ImagePrepareConfig, storage: StorageConfig) -> Source:
    """The images of data.prepare.images's source."""
    readers = {"imagefolder": imagefolder_source, "hf": hf_source, "webdataset": webdataset_source}
    return readers[cfg.kind](cfg, storage)


def decode_image(data: bytes, image_size: int, digest: bool = True) -> tuple[dict[str, Any], np.ndarray | None]:
    """Decode, orient (EXIF), convert to RGB, crop the centred square and resize to image_size: the row's fields
    (width, height, mode, with `digest` the sha256 of the decoded pixels; or the error) and the (S, S, 3) uint8
    pixels."""
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            mode = opened.mode
            image = ImageOps.exif_transpose(opened)
            width, height = image.size
            if mode in LOSSY_MODES:
                return {"decodable": True, "width": width, "height": height, "mode": mode}, None
            rgb = image.convert("RGB")
    except Exception as err:  # noqa: BLE001 - whatever Pillow raises on a foreign or cut-short file is the finding
        return {"decodable": False, "error": f"{type(err).__name__}: {err}"[:200]}, None
    fields = {"decodable": True, "width": width, "height": height, "mode": mode}
    if digest:
        fields["sha256"] = hashlib.sha256(f"{width}x{height}:".encode() + rgb.tobytes()).hexdigest()
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    square = rgb.crop((left, top, left + side, top + side)) if width != height else rgb
    resized = square.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return fields, np.asarray(resized, dtype=np.uint8)


def _decode_one(image: SourceImage, image_size: int, validate: bool, hashes: bool) -> Decoded:
    try:
        data = image.read()
    except Exception as err:
        if is_connection_error(err):
            raise
        fields: dict[str, Any] = {"decodable": False, "error": f"cannot read: {type(err).__name__}: {err}"[:200]}
        pixels = None
    else:
        fields, pixels = decode_image(data, image_size, digest=validate)
    if pixels is not None and hashes:
        fields["phash"] = phash64(pixels)
    row = ImageRow(file=image.name, split="", label=image.label, label_name=image.label_name, **fields)
    return Decoded(row, pixels)


def split_images(images: list[SourceImage], kind: str, val_fraction: float, seed: int) -> list[str]:
    """Each image's split: the source's where it gives one, else seeded (stratified by label for labels)."""
    if all(image.split is not None for image in images):
        return [str(image.split) for image in images]
    rng = np.random.default_rng(seed)
    splits = ["train"] * len(images)
    groups: dict[Any, list[int]] = {}
    for number, image in enumerate(images):
        groups.setdefault(image.label if kind == "labels" else None, []).append(number)
    for group in sorted(groups, key=lambda g: (g is None, str(g))):
        members = groups[group]
        held = int(round(len(members) * val_fraction))
        for number in rng.permutation(members)[:held]:
            splits[int(number)] = "val"
    return splits


def caption_tokenizer(cfg: PrepareConfig, storage: StorageConfig, train_captions: list[str]) -> TextTokenizer:
    """data.prepare.tokenizer: bytes, a tokenizer file, or a BPE trained on the training split's captions."""
    tok = cfg.tokenizer
    if tok.kind == "bytes":
        return TextTokenizer("bytes")
    if tok.path:
        return load_tokenizer(tok.path, tok, storage)
    return train_bpe(train_captions, tok)


def caption_ids(tokenizer: TextTokenizer, captions: list[str], max_tokens: int) -> tuple[np.ndarray, list[int]]:
    """(N, max_tokens + 1) ids (caption, EOS, then EOS as padding; longer captions cut) and each caption's length."""
    assert tokenizer.eos_id is not None
    encoded = tokenizer.encode_batch(captions) if captions else []
    out = np.full((len(captions), max_tokens + 1), tokenizer.eos_id, dtype=np.int32)
    for number, ids in enumerate(encoded):
        out[number, : min(len(ids), max_tokens)] = ids[:max_tokens]
    return out, [len(ids) for ids in encoded]


def image_key(cfg: PrepareConfig, source: Source, tokenizer_sha256: str | None) -> str:
    """Content address of the image dataset: inputs, every image setting, the tokenizer, the code."""
    import importlib.metadata

    images = cfg.images
    assert images is not None
    code = {"pipeline": PIPELINE_VERSION, "pillow": importlib.metadata.version("pillow"),
            "imagehash": importlib.metadata.version("imagehash")}  # fmt: skip
    settings: dict[str, Any] = {"images": images.model_dump()}
    if images.target_kind == "captions":
        settings["tokenizer"] = cfg.tokenizer.model_dump()
        if cfg.tokenizer.kind == "bpe":
            code["tokenizers"] = importlib.metadata.version("tokenizers")
    material = {"format": f"images-{FORMAT_VERSION}", "settings": settings, "inputs": source.fingerprint,
                "tokenizer": tokenizer_sha256, "code": code}  # fmt: skip
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def prepare_images(
    cfg: PrepareConfig, storage: StorageConfig, progress: Progress | None = None, validate: bool = True
) -> PrepareResult:
    """Prepare (or reuse) data.prepare.images's dataset; raises UserError / TransientError / DataValidationError."""
    with unreachable_storage_is_transient(_FIELD):
        return _prepare(cfg, storage, progress, validate)


def _prepare(cfg: PrepareConfig, storage: StorageConfig, progress: Progress | None, validate: bool) -> PrepareResult:
    images = cfg.images
    assert images is not None, "prepare_images runs for data.prepare.images"
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    source = read_source(images, storage)
    given = None
    if images.target_kind == "captions" and cfg.tokenizer.kind == "bpe" and cfg.tokenizer.path:
        given = load_tokenizer(cfg.tokenizer.path, cfg.tokenizer, storage)
    key = image_key(cfg, source, given.sha256 if given else None)
    url = join(cfg.output_url, key)
    fs, root = filesystem(url, storage)
    seconds["inputs"] = time.perf_counter() - started
    if fs.exists(join(root, MANIFEST)):
        return _reuse(url, key, storage, seconds, started)

    prepared = _decode_and_split(cfg, images, storage, source, progress, validate)
    seconds.update(prepared.seconds)
    rows = [d.row for d in prepared.decoded]
    runner = None
    report: dict[str, Any] = {"success": None, "skipped": True}
    report_url = docs_url = ""
    try:
        if validate:
            from validation.data import SuiteReport, SuiteRunner
            from validation.image_data import run_image_suite

            t0 = time.perf_counter()
            runner = SuiteRunner()
            suite = run_image_suite(
                runner, rows, images, kind=images.target_kind, num_classes=source.num_classes,
                class_names=source.class_names, max_caption_tokens=images.max_caption_tokens,
            )  # fmt: skip
            result = SuiteReport(suite.success, suite.evaluated, suite.failed, problems=suite.problems)
            counts = _split_counts(rows)
            report_url, docs_url = publish_image_validation(url, storage, result, runner, counts)
            report = result.to_json()
            seconds["validate"] = time.perf_counter() - t0
            if not suite.success:
                raise DataValidationError(
                    f"image dataset {url}", suite.failed, report_url, docs_url, _listed(suite.problems),
                    fix=f"fix the images or the thresholds in {_FIELD}; nothing was written",
                )  # fmt: skip
        t0 = time.perf_counter()
        manifest = _write(cfg, images, storage, url, key, source, prepared)
        seconds["write"] = time.perf_counter() - t0
    finally:
        if runner is not None:
            runner.close()
    seconds["total"] = time.perf_counter() - started
    return _result(url, key, False, manifest, len(rows), report, report_url, docs_url, seconds)


def _listed(problems: list[DataProblem]) -> list[DataProblem]:
    """The first MAX_PROBLEMS defects, then one line counting the rest."""
    from validation.image_data import MAX_PROBLEMS

    if len(problems) <= MAX_PROBLEMS:
        return problems
    rest = DataProblem(None, f"and {len(problems) - MAX_PROBLEMS} more defects", "see the report")
    return [*problems[:MAX_PROBLEMS], rest]


def _decode_and_split(cfg: PrepareConfig, images: ImagePrepareConfig, storage: StorageConfig, source: Source,
                      progress: Progress | None, validate: bool) -> _Prepared:  # fmt: skip
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    hashes = validate and images.near_dup_max_distance is not None
    total = len(source.images)
    decoded: list[Decoded] = []
    with ThreadPoolExecutor(max_workers=encode_threads(cfg.workers), thread_name_prefix="decode") as pool:
        for number, item in enumerate(
            pool.map(lambda image: _decode_one(image, images.image_size, validate, hashes), source.images), start=1
        ):
            decoded.append(item)
            if progress and (number % 256 == 0 or number == total):
                progress("decode", number, total)
    seconds["decode"] = time.perf_counter() - t0
    split_of = split_images(source.images, images.target_kind, images.val_fraction, images.seed)
    for item, split in zip(decoded, split_of, strict=True):
        item.row.split = split
    tokenizer = None
    if images.target_kind == "captions":
        t0 = time.perf_counter()
        captions = [image.caption or "" for image in source.images]
        train = [c for c, s in zip(captions, split_of, strict=True) if s == "train"]
        tokenizer = caption_tokenizer(cfg, storage, train)
        ids, lengths = caption_ids(tokenizer, captions, images.max_caption_tokens)
        for number, item in enumerate(decoded):
            item.row.caption_tokens = lengths[number]
            item.caption_ids = ids[number]
        seconds["tokenize"] = time.perf_counter() - t0
    return _Prepared(decoded, split_of, tokenizer, seconds)


def _storable(item: Decoded, images: ImagePrepareConfig, num_classes: int | None) -> bool:
    """Whether the image can be stored (the suite refuses a dataset with any that cannot; without the suite they
    are left out)."""
    if item.pixels is None:
        return False
    if images.target_kind == "labels":
        return item.row.label is not None and 0 <= item.row.label < (num_classes or 0)
    return True


def _write(cfg: PrepareConfig, images: ImagePrepareConfig, storage: StorageConfig, url: str, key: str,
           source: Source, prepared: _Prepared) -> ImageManifest:  # fmt: skip
    """Write the dataset (IMAGES.json last); an unfinished folder is removed on failure."""
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split in SPLITS:
        chosen = [d for d, s in zip(prepared.decoded, prepared.split_of, strict=True)
                  if s == split and _storable(d, images, source.num_classes)]  # fmt: skip
        pixels = np.zeros((len(chosen), images.image_size, images.image_size, 3), dtype=np.uint8)
        for number, item in enumerate(chosen):
            pixels[number] = item.pixels
        if images.target_kind == "labels":
            targets = np.array([item.row.label for item in chosen], dtype=np.int32)
        else:
            targets = np.array([item.caption_ids for item in chosen], dtype=np.int32).reshape(
                len(chosen), images.max_caption_tokens + 1
            )
        splits[split] = (pixels, targets)
    dropped = len(prepared.decoded) - sum(len(p) for p, _ in splits.values())
    if dropped:
        log.warning("%s: %d images that cannot be stored were left out (validation is off)", url, dropped)
    tok = prepared.tokenizer
    fields: dict[str, Any] = {"num_classes": source.num_classes, "class_names": source.class_names}
    if tok is not None:
        fields = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "pad_id": tok.eos_id,
                  "tokenizer": tok.info(), "tokenizer_json": tok.json_text}  # fmt: skip
    fs, root = filesystem(url, storage)
    try:
        counts = {"images": {"read": len(prepared.decoded), "dropped": dropped, "key": key}}
        write_bytes_atomic(fs, join(root, PREPARE_FILE), json.dumps(counts, indent=2).encode())
        return write_image_dataset(url, storage, splits, kind=images.target_kind, source_fingerprint=key,
                                   shard_images=images.shard_images, **fields)  # fmt: skip
    except BaseException as err:
        _remove_uncommitted(fs, root, url)
        if isinstance(err, Exception) and is_no_space(err):
            raise NoSpaceError(url, "the image dataset", None, free_bytes(url),
                               "free space there or point data.prepare.output_url at a disk with more room") from err
        raise


def _remove_uncommitted(fs: Any, root: str, url: str) -> None:
    """Delete the shards of a dataset whose IMAGES.json was never written (the error raised stays the one shown)."""
    try:
        if fs.exists(root) and not fs.exists(join(root, MANIFEST)):
            fs.rm(root, recursive=True)
    except Exception as err:  # noqa: BLE001 - the original failure matters more than the clean-up's
        log.warning("could not remove the unfinished image dataset %s: %s", url, err)


def _split_counts(rows: list[ImageRow]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        counts.setdefault(row.split, {"images": 0})["images"] += 1
    return dict(sorted(counts.items()))


def publish_image_validation(url: str, storage: StorageConfig, report: Any, runner: Any,
                             splits: dict[str, dict[str, int]]) -> tuple[str, str]:  # fmt: skip
    """Write validation.json, the offline report and GE's Data Docs under the dataset's folder (also for a
    dataset refused, which has no IMAGES.json); returns the URLs of validation.json and the report's index."""
    from validation.data_report import INDEX, ReportContext, render_pages

    fs, root = filesystem(url, storage)
    report_path = join(root, VALIDATION_FILE)
    write_bytes_atomic(fs, report_path, json.dumps(report.to_json(), indent=2, default=str).encode())
    fs.put(runner.build_docs().rstrip("/") + "/", join(root, DATA_DOCS_DIR), recursive=True)
    context = ReportContext(
        dataset_url=url,
        splits=splits,
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        ge_docs_href=f"{posixpath.relpath(DATA_DOCS_DIR, REPORT_DIR)}/index.html",
        problems=list(report.problems),
    )
    pages = join(root, REPORT_DIR)
    for name, page in render_pages(runner.runs, context).items():
        write_bytes_atomic(fs, join(pages, name), page.encode())
    prefix = f"{url.split('://', 1)[0]}://" if "://" in url else ""
    return prefix + report_path, prefix + join(pages, INDEX)


def _reuse(url: str, key: str, storage: StorageConfig, seconds: dict[str, float], started: float) -> PrepareResult:
    """The finished dataset under the key, after checking its files' sizes (a broken one is uncommitted)."""
    log.info("reusing the finished image dataset %s (same inputs and settings)", url)
    problems = verify_image_dataset(url, storage)
    fs, root = filesystem(url, storage)
    if problems:
        fs.mv(join(root, MANIFEST), join(root, REJECTED_MANIFEST))
        raise DataValidationError(
            f"image dataset {url} (reused from the store)", [], None,
            problems=[DataProblem(None, p, "rebuild it") for p in problems],
            fix=f"its manifest was moved to {REJECTED_MANIFEST}: the next run rebuilds it",
        )  # fmt: skip
    manifest = read_image_manifest(url, storage)
    report: dict[str, Any] = {"success": None, "skipped": True}
    report_url = docs_url = ""
    if fs.exists(join(root, VALIDATION_FILE)):
        report = json.loads(read_control_file(fs, join(root, VALIDATION_FILE)))
        prefix = f"{url.split('://', 1)[0]}://" if "://" in url else ""
        report_url, docs_url = prefix + join(root, VALIDATION_FILE), prefix + join(root, REPORT_DIR, "index.html")
    count = sum(s.count for s in manifest.splits.values())
    seconds["total"] = time.perf_counter() - started
    return _result(url, key, True, manifest, count, report, report_url, docs_url, seconds)


def _result(url: str, key: str, reused: bool, manifest: ImageManifest, read: int, report: dict[str, Any],
            report_url: str, docs_url: str, seconds: dict[str, float]) -> PrepareResult:  # fmt: skip
    kept = sum(s.count for s in manifest.splits.values())
    return PrepareResult(
        dataset_url=url,
        key=key,
        reused=reused,
        cleaning={"read": read, "removed": {"not storable": read - kept} if read != kept else {}, "kept": kept},
        splits={name: {"images": s.count} for name, s in manifest.splits.items()},
        vocab_size=manifest.vocab_size,  # type: ignore[arg-type]  # None for labels: no vocabulary
        tokenizer_sha256=manifest.tokenizer.sha256 if manifest.tokenizer else None,
        validation=report,
        validation_url=report_url,
        data_docs_url=docs_url,
        seconds=seconds,
    )

