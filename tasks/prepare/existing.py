"""The data step for a dataset given by URL (data.dataset_url): the token suite over the whole dataset.

A dataset made elsewhere is untrusted input, and a bad token id that training would first draw after the
acceptance steps is never seen by them. So before any job starts, every shard is streamed once through the
dataset suite (validation/data.py): every token id below the model's vocab_size and the manifest's, the token
and document counts of every shard and split against the manifest and the files' sizes, the document index
(starting at 0, never decreasing, ending at the shard's length), and every file's sha256. With
data.tokenizer_sha256 set, the manifest's tokenizer and its tokenizer.json must be that one.

The verdict of a dataset that passed is kept in the deployment's reports, never in the dataset's folder:
`<reports_dir>/data-validation/<key>/verdict.json` beside that validation's report, where the key hashes the
manifest (every checksum and count), the identity of every file it names (size and modification time, inode
or ETag), the model's vocab_size, the splits, the expected tokenizer and the suite's version. A rerun on the
same unchanged dataset reads the verdict instead of rescanning; a change to any of them rescans.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.errors import TransientError, UserError, is_connection_error
from tasks.paths import adopted_root, data_validation_dir
from tasks.prepare.config import DataSpec
from tasks.prepare.pipeline import DataValidationError, publish_validation
from training.dataset import MANIFEST, DatasetError, DatasetManifest, ShardLocator, read_manifest
from training.storage import StorageConfig, filesystem, join
from validation.data import (
    SUITE_VERSION,
    DataExpectations,
    DataProblem,
    SuiteReport,
    TokenizerExpectation,
    run_dataset_suite,
    tokenizer_problems,
)

log = logging.getLogger(__name__)

VERDICT_FILE = "verdict.json"
"""Written last in a validation's folder, and only when the dataset passed: its presence is the cached verdict."""
_IDENTITY_KEYS = ("mtime", "created", "ino", "ETag", "etag", "LastModified", "last_modified", "generation", "md5Hash")
_FIX = "nothing was trained; fix the dataset at data.dataset_url (or point it at another) and run again"


@dataclass
class CheckedDataset:
    """What the data step found of a dataset given by URL (small and JSON-safe)."""

    dataset_url: str
    """The dataset checked: data.dataset_url, or the adoption of what it (or data.blend) names."""
    sources: list[str]
    """Adopted sources the dataset's manifest names outside its folder (the training job's DataConfig.sources)."""
    key: str
    """The verdict's cache key (see the module's docstring)."""
    cached: bool
    """True when the verdict of an earlier identical check was reused (nothing was rescanned)."""
    splits: dict[str, dict[str, int]]
    vocab_size: int
    tokenizer_sha256: str | None
    validation: dict[str, Any]
    validation_url: str
    data_docs_url: str
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As a dict."""
        return asdict(self)


def check_dataset_url(data: DataSpec, vocab_size: int, storage: StorageConfig, reports_dir: str) -> CheckedDataset:
    """Validate data.dataset_url for a model of `vocab_size`, or reuse the verdict of an identical check.

    Raises DataValidationError (a user error naming the file, the value and the fix), DatasetError (no
    readable manifest) or TransientError (storage unreachable: the step retries).
    """
    assert data.given, "the prepare path validates its own datasets"
    try:
        return _check(data, vocab_size, storage, reports_dir)
    except (UserError, TransientError, DatasetError):
        raise
    except Exception as err:
        if is_connection_error(err):
            raise TransientError(
                f"data.dataset_url={data.dataset_url}: storage unreachable: {err}",
                "check the endpoint (storage.s3_endpoint_url) and network; the step retries",
            ) from err
        raise


def _given_dataset(data: DataSpec, vocab_size: int, storage: StorageConfig, reports_dir: str) -> tuple[str, list[str]]:
    """The dataset to check and the sources its manifest may name: data.dataset_url itself when it is a dataset of
    ours, else the adoption of what data.dataset_url or data.blend names (tasks/prepare/adopt.py)."""
    from tasks.prepare.adopt import adopt_given, detect_kind

    if data.blend is None and data.dataset_url is not None:
        if detect_kind(data.dataset_url, storage, "data.dataset_url") == "tdeploy":
            if data.tokenizer_url is not None:
                raise UserError(
                    f"data.tokenizer_url={data.tokenizer_url}: data.dataset_url={data.dataset_url} is a dataset "
                    "tdeploy made, which records its own tokenizer",
                    "leave data.tokenizer_url out (data.tokenizer_sha256 pins a tokenizer)",
                )
            return data.dataset_url, []
    adoption = adopt_given(data, vocab_size, storage, adopted_root(data.adopted_url, reports_dir))
    log.info("%s adopted as %s (%s)", [s.url for s in data.given], adoption.dataset_url, ", ".join(adoption.kinds))
    return adoption.dataset_url, adoption.sources


def _check(data: DataSpec, vocab_size: int, storage: StorageConfig, reports_dir: str) -> CheckedDataset:
    started = time.perf_counter()
    url, trusted = _given_dataset(data, vocab_size, storage, reports_dir)
    manifest = read_manifest(url, storage, trusted)
    where = f"data.dataset_url={url}" if data.dataset_url == url else f"adopted dataset {url}"
    upfront = _spec_problems(data, url, vocab_size, manifest, storage)
    if upfront:
        raise DataValidationError(where, [], None, problems=upfront, fix=_FIX)
    key = verdict_key(data, url, vocab_size, manifest, storage, trusted)
    folder = data_validation_dir(reports_dir, key)
    cached = _read_verdict(folder, key)
    if cached is not None:
        log.info("%s: the token suite passed on this very dataset before (%s); not rescanned", url, folder)
        cached.seconds = {"total": time.perf_counter() - started}
        return cached

    from validation.data import SuiteRunner

    t0 = time.perf_counter()
    with SuiteRunner() as runner:
        suite = run_dataset_suite(
            runner, url, DataExpectations(), None, storage,
            vocab_size=vocab_size, val_split=data.val_split, documents=False, trusted=trusted,
        )  # fmt: skip
        report = SuiteReport(suite.success, suite.evaluated, suite.failed, problems=suite.problems)
        report_url, docs_url = publish_validation(url, str(folder), storage, report, runner, manifest)
    seconds = {"validate_dataset": time.perf_counter() - t0}
    if not report.success:
        raise DataValidationError(where, report.failed, report_url, docs_url, report.problems, fix=_FIX)
    seconds["total"] = time.perf_counter() - started
    result = CheckedDataset(
        dataset_url=url,
        sources=trusted,
        key=key,
        cached=False,
        splits=suite.splits,
        vocab_size=manifest.vocab_size,
        tokenizer_sha256=manifest.tokenizer.sha256,
        validation=report.to_json(),
        validation_url=report_url,
        data_docs_url=docs_url,
        seconds=seconds,
    )
    _write_verdict(folder, result)
    return result


def _spec_problems(
    data: DataSpec, url: str, vocab_size: int, manifest: DatasetManifest, storage: StorageConfig
) -> list[DataProblem]:
    """What the manifest alone shows to be wrong for this spec: splits, vocabulary, tokenizer."""
    problems = [
        DataProblem(
            MANIFEST,
            f"no split {name!r} (data.{field_name}); the dataset has {sorted(manifest.splits)}",
            f"set data.{field_name} to one of them",
        )
        for field_name, name in (("train_split", data.train_split), ("val_split", data.val_split))
        if name not in manifest.splits
    ]
    if manifest.vocab_size > vocab_size:
        problems.append(
            DataProblem(
                MANIFEST,
                f"dataset vocab_size={manifest.vocab_size} exceeds model.vocab_size={vocab_size}",
                f"set model.vocab_size >= {manifest.vocab_size} or use a dataset of this vocabulary",
            )
        )
    if data.tokenizer_sha256 is not None:
        expected = TokenizerExpectation("data.tokenizer_sha256", sha256=data.tokenizer_sha256)
        problems += tokenizer_problems(url, manifest, expected, storage)
    return problems


def verdict_key(
    data: DataSpec,
    url: str,
    vocab_size: int,
    manifest: DatasetManifest,
    storage: StorageConfig,
    trusted: list[str] | None = None,
) -> str:
    """The cache key of a verdict: manifest bytes, every named file's identity (adopted sources' too), the
    model's vocabulary, the splits, the expected tokenizer and the suite's version."""
    fs, root = filesystem(url, storage)
    locator = ShardLocator(url, storage)
    files: dict[str, Any] = {}
    for split in manifest.splits.values():
        for shard in split.shards:
            try:
                found = locator.files(shard)
            except DatasetError as err:  # a link out of the dataset: the suite reports it; no verdict is kept
                found = [(err.file or shard.tokens, "", None, False, None)]
            files |= {rel: None if identity is None else list(identity) for rel, _, _, _, identity in found}
    if manifest.tokenizer.path is not None:
        info = fs.find(root, detail=True).get(join(root, manifest.tokenizer.path))
        files[manifest.tokenizer.path] = _identity(info)
    material = {
        "suite": SUITE_VERSION,
        "dataset_url": url,
        "sources": trusted or [],
        "manifest_sha256": hashlib.sha256(fs.cat_file(join(root, MANIFEST))).hexdigest(),
        "files": files,
        "vocab_size": vocab_size,
        "splits": [data.train_split, data.val_split],
        "tokenizer_sha256": data.tokenizer_sha256,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _identity(info: dict[str, Any] | None) -> list[Any] | None:
    """What changes when a file is rewritten or replaced (size, times, inode; or size and ETag); None if missing."""
    if info is None:
        return None
    return [info.get("size"), *(str(info[k]) for k in _IDENTITY_KEYS if k in info)]


def _read_verdict(folder: Path, key: str) -> CheckedDataset | None:
    path = folder / VERDICT_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("%s: unreadable cached verdict (%s); rescanning", path, err)
        return None
    if record.get("key") != key or not record.get("validation", {}).get("success"):
        return None
    try:
        return CheckedDataset(**{**record, "cached": True})
    except TypeError as err:
        log.warning("%s: cached verdict of another layout (%s); rescanning", path, err)
        return None


def _write_verdict(folder: Path, result: CheckedDataset) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / VERDICT_FILE
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result.to_json(), indent=2))
    os.replace(tmp, path)
