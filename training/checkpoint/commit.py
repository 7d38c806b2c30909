"""The commit protocol's record: COMMIT.json names every file of a step folder with its sha256 and size, and is
written last; these read and check it (and the small JSON files beside it) as the loader and the ledger see them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
from typing import Any

import fsspec

from training.checkpoint.errors import CheckpointCopyError, CheckpointFormatError
from training.checkpoint.files import COMMIT, STEP_DIR, step_dir_name
from training.checkpoint.space import MAX_IO_THREADS
from training.checkpoint.writer import fsync_path
from training.storage import (
    ControlFileError,
    DigestingWriter,
    StorageConfig,
    filesystem,
    is_local,
    join,
    read_control_file,
    sha256_files,
    write_bytes_atomic,
)

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COPY_CHUNK_BYTES = 8 << 20
_CORRUPT_FIX = "the checkpoint was altered or its save never finished: copy another committed step"


def parse_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(where, f"is not valid JSON: {err}") from err
    except (ValueError, RecursionError) as err:  # a 5,000-digit integer, nesting deeper than the stack
        raise CheckpointFormatError(where, f"is not JSON this trainer writes: {type(err).__name__}") from err


def check_train_state(value: Any, step: int, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointFormatError(where, f"holds a JSON {type(value).__name__}, not the object of training state")
    if "step" in value and value["step"] != step:
        raise CheckpointFormatError(where, f"says step {value['step']!r}, but it sits in {step_dir_name(step)}")
    return value


def _safe_relative(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def check_commit(value: Any, step: int, where: str) -> dict[str, Any]:
    """A COMMIT.json record as `commit()` writes it, or CheckpointFormatError saying what is off."""
    if not isinstance(value, dict):
        raise CheckpointFormatError(where, f"holds a JSON {type(value).__name__}, not a commit record")
    if value.get("step") != step:
        raise CheckpointFormatError(where, f"says step {value.get('step')!r}, but it sits in {step_dir_name(step)}")
    world = value.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointFormatError(where, f"has world_size={world!r}; expected a positive integer")
    layout = value.get("layout", "")
    if not isinstance(layout, str) or len(layout) > 200:
        raise CheckpointFormatError(where, f"has layout={layout!r}; expected a short string")
    contents = value.get("contents", ["model", "optim"])
    if not isinstance(contents, list) or not set(contents) <= {"model", "optim"} or "model" not in contents:
        raise CheckpointFormatError(where, f"has contents={contents!r}; expected ['model'] or ['model', 'optim']")
    files = value.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointFormatError(where, "lists no files")
    for rel, entry in files.items():
        if not _safe_relative(rel):
            raise CheckpointFormatError(where, f"lists the file {rel!r}, which is not a path inside the step folder")
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not ok or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointFormatError(where, f"has the entry {rel!r}: {entry!r}; expected sha256 and bytes")
    return value


def commit_digest(step_dir: str, storage: StorageConfig) -> str:
    """sha256 of the COMMIT.json of the checkpoint step folder `step_dir` (a path or fsspec URL): what names one
    committed checkpoint, as the ledger records it. FileNotFoundError when the step is not committed;
    CheckpointFormatError when its COMMIT.json is no small regular file."""
    fs, path = filesystem(step_dir, storage)
    try:
        return hashlib.sha256(read_control_file(fs, join(path, COMMIT))).hexdigest()
    except ControlFileError as err:
        raise CheckpointFormatError(join(step_dir, COMMIT), err.problem) from err


def copy_step(
    src_step_dir: str, dst_dir: str, storage: StorageConfig, expect_commit_sha256: str | None = None
) -> str:
    """Copy the committed checkpoint step folder `src_step_dir` into the checkpoint folder `dst_dir` (under its
    step-<N> name) by the commit protocol; the copy's step folder URL.

    Only the files COMMIT.json lists are copied, each checked against its recorded sha256 and size on the way and
    hashed again on the copy; COMMIT.json (the same bytes: `commit_digest` of the copy is the source's) is written
    last. CheckpointCopyError names the file when the source is not committed, its COMMIT.json is not
    `expect_commit_sha256` (when given), a file differs from its record, or the destination step exists. A copy
    that fails for any reason is removed; one cut short by a crash has no COMMIT.json (a partial checkpoint).
    """
    name = posixpath.basename(src_step_dir.rstrip("/"))
    match = STEP_DIR.fullmatch(name)
    if match is None:
        raise CheckpointCopyError(
            src_step_dir,
            "is not a checkpoint step folder (step-<8 digits>)",
            "pass the folder of one checkpoint step, e.g. <checkpoint.url>/step-00000040",
        )
    src_fs, src = filesystem(src_step_dir, storage)
    raw, commit = _committed_record(src_fs, src, src_step_dir, int(match.group(1)), expect_commit_sha256)
    dst_fs, dst_root = filesystem(dst_dir, storage)
    dst, dst_url = join(dst_root, name), join(dst_dir, name)
    if dst_fs.exists(dst):
        raise CheckpointCopyError(
            dst_url, "exists already", "copy into a checkpoint folder without that step (a fresh folder)"
        )
    try:
        _copy_listed(src_fs, src, src_step_dir, dst_fs, dst, dst_url, commit["files"], is_local(dst_dir))
        write_bytes_atomic(dst_fs, join(dst, COMMIT), raw)
        if is_local(dst_dir):
            fsync_path(dst)  # COMMIT.json's name: the copy's commit is durable
    except BaseException:
        _remove_copy(dst_fs, dst, dst_url)
        raise
    return dst_url


def _committed_record(
    fs: fsspec.AbstractFileSystem, path: str, url: str, step: int, expect_sha256: str | None
) -> tuple[bytes, dict[str, Any]]:
    """The bytes and the checked record of the COMMIT.json of the step folder `path` (`url`), or
    CheckpointCopyError naming it."""
    where = join(url, COMMIT)
    try:
        raw = read_control_file(fs, join(path, COMMIT))
    except FileNotFoundError as err:
        raise CheckpointCopyError(
            where, "is missing: the step is not committed (its save never finished)", "copy a committed step"
        ) from err
    except ControlFileError as err:
        raise CheckpointCopyError(where, err.problem, _CORRUPT_FIX) from err
    digest = hashlib.sha256(raw).hexdigest()
    if expect_sha256 is not None and digest != expect_sha256:
        raise CheckpointCopyError(
            where,
            f"has sha256 {digest}, not the {expect_sha256} recorded for it",
            "copy the checkpoint that was recorded; this one was replaced after it was recorded",
        )
    try:
        commit = check_commit(parse_json(raw, where), step, where)
    except CheckpointFormatError as err:
        raise CheckpointCopyError(err.path, err.problem, _CORRUPT_FIX) from err
    if COMMIT in commit["files"]:
        raise CheckpointCopyError(where, f"lists {COMMIT} itself among its files", _CORRUPT_FIX)
    return raw, commit


def _copy_listed(
    src_fs: fsspec.AbstractFileSystem,
    src: str,
    src_url: str,
    dst_fs: fsspec.AbstractFileSystem,
    dst: str,
    dst_url: str,
    files: dict[str, dict[str, Any]],
    local: bool,
) -> None:
    """Copy each listed file, checking it against its record, then hash the copies; local copies are fsynced,
    files and folders, before the caller commits."""
    for rel, entry in sorted(files.items()):
        digest, nbytes = _copy_file(src_fs, join(src, rel), dst_fs, join(dst, rel), entry["bytes"], local)
        if nbytes != entry["bytes"]:
            problem = f"holds {'more than ' if nbytes > entry['bytes'] else ''}{nbytes} bytes, {COMMIT} says"
            raise CheckpointCopyError(join(src_url, rel), f"{problem} {entry['bytes']}", _CORRUPT_FIX)
        if digest != entry["sha256"]:
            raise CheckpointCopyError(join(src_url, rel), "fails its sha256 check", _CORRUPT_FIX)
    copies = {join(dst, rel): rel for rel in files}
    for full, digest in sorted(sha256_files(dst_fs, copies, MAX_IO_THREADS).items()):
        if digest != files[copies[full]]["sha256"]:
            raise CheckpointCopyError(
                join(dst_url, copies[full]),
                "fails its sha256 check after the copy (the destination storage changed it)",
                "check the destination storage, then copy again",
            )
    if local:
        folders = {posixpath.dirname(full) for full in copies} | {dst}
        for folder in [*sorted(folders, reverse=True), posixpath.dirname(dst.rstrip("/")) or "."]:
            fsync_path(folder)


def _copy_file(
    src_fs: fsspec.AbstractFileSystem, src: str, dst_fs: fsspec.AbstractFileSystem, dst: str, limit: int, local: bool
) -> tuple[str, int]:
    """Stream `src` into `dst` (at most `limit` + 1 bytes: a longer file is reported, not copied whole); the
    sha256 and size of what was written."""
    if local:
        os.makedirs(posixpath.dirname(dst), exist_ok=True)
    with src_fs.open(src, "rb") as reader, dst_fs.open(dst, "wb") as out:
        writer = DigestingWriter(out)
        while writer.nbytes <= limit and (chunk := reader.read(min(_COPY_CHUNK_BYTES, limit + 1 - writer.nbytes))):
            writer.write(chunk)
        if local:
            out.flush()
            os.fsync(out.fileno())
    return writer.hexdigest(), writer.nbytes


def _remove_copy(fs: fsspec.AbstractFileSystem, path: str, url: str) -> None:
    """Remove a failed copy's step folder (it has no COMMIT.json, so it would only be skipped as partial)."""
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as err:  # noqa: BLE001 - the copy already failed; this is cleanup on broken storage
        log.warning("could not remove the partial checkpoint copy %s: %s", url, err)
