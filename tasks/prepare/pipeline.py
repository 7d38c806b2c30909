"""The data-preparation step: read, clean, validate documents, tokenize, shard, index, validate the dataset.

With a tokenizer known up front (a tokenizer file, or bytes) the corpus is read once: documents are
cleaned, split and batched here while `workers` threads encode earlier batches and the finished ones are
written in order (tasks/prepare/encoding.py). A BPE trained on the data needs the whole training split
first, so the cleaned documents are staged on local disk, the BPE is trained, and the staged documents
are then encoded the same way. Either way the dataset's bytes depend on the inputs and settings only,
never on `workers` or `batch_documents`.

The dataset goes to `<output_url>/<key>/` where the key hashes the inputs (each
file's fsspec checksum: size and modification time or ETag), every setting that
can change a token (all but NOT_TOKEN_SETTINGS), the tokenizer and the versions
of the code behind the tokens; re-running with the same key reuses the finished
dataset (after re-checking it, and its tokenizer against the spec's), anything
changed makes a new one. `manifest.json` is written
last, so a half-written dataset is never taken for a finished one; one whose
dataset suite fails has its manifest moved to `manifest.rejected.json`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from posixpath import relpath
from typing import Any

from tasks.errors import NoSpaceError, TransientError, UserError, is_connection_error
from tasks.prepare.clean import CleaningStats, cleaned_with_digests
from tasks.prepare.config import PrepareConfig
from tasks.prepare.corpus import split_of_digest
from tasks.prepare.encoding import encode_threads
from tasks.prepare.sources import SourceFile, expand_sources, iter_documents
from tasks.prepare.tokenizer import BYTE_EOS, TOKENIZER_FILE, TextTokenizer, load_tokenizer, train_bpe
from training.dataset import FORMAT_VERSION, MANIFEST, DatasetManifest, DatasetWriter, read_manifest
from training.storage import (
    StorageConfig,
    filesystem,
    free_bytes,
    is_no_space,
    join,
    read_control_file,
    write_bytes_atomic,
)
from validation.data import DataProblem, TokenizerExpectation, tokenizer_problems

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int | None], None]
"""progress(stage, done, total): called as work advances (total None when unknown)."""

PREPARE_FILE = "prepare.json"
REJECTED_MANIFEST = "manifest.rejected.json"
"""A finished dataset whose checks failed: its manifest, moved aside (the dataset reads as unfinished)."""
VALIDATION_FILE = "validation/validation.json"
DATA_DOCS_DIR = "validation/data_docs"
"""Great Expectations' own Data Docs (their styling and scripts come from CDNs)."""
REPORT_DIR = "validation/report"
"""The offline report: `index.html` and one page per validation; `data_docs_url` points at its index."""


class DataValidationError(UserError):
    """A data check failed; `problems` lists each defect (file, value, fix), `failed` each failed expectation.

    `report_url` is validation.json and `docs_url` the offline report's index, where they were published.
    """

    def __init__(
        self,
        where: str,
        failed: list[Any],
        report_url: str | None,
        docs_url: str | None = None,
        problems: Sequence[Any] = (),
        fix: str = "fix the data or the thresholds in data.prepare.expectations",
    ) -> None:
        found = "; ".join(p.describe() for p in problems)
        names = "; ".join(f.describe() for f in failed)
        if found and names:
            found += f" [failed expectations: {names}]"
        published = ""
        if report_url:
            published = f" (report: {report_url}; page: {docs_url})" if docs_url else f" (report: {report_url})"
        super().__init__(f"{where}: data validation failed: {found or names}", fix + published)
        self.failed, self.problems, self.report_url, self.docs_url = failed, list(problems), report_url, docs_url
        self._args = (where, failed, report_url, docs_url, list(problems), fix)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by the constructor's arguments (Prefect stores a failed task's exception)."""
        return (type(self), self._args)


@dataclass
class PrepareResult:
    """What the step produced (small and JSON-safe: it is the Prefect task's result)."""

    dataset_url: str
    key: str
    reused: bool
    cleaning: dict[str, Any]
    splits: dict[str, dict[str, int]]
    vocab_size: int
    tokenizer_sha256: str | None
    validation: dict[str, Any]
    validation_url: str
    data_docs_url: str
    """Index of the offline report (self-contained pages); GE's own Data Docs are in DATA_DOCS_DIR beside it."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage: `read_tokenize_write` (one pass), or `read_clean`, `tokenizer` (BPE training) and
    `tokenize_write` (staged, for a BPE trained here); `validate_*`, `inputs` and `total`."""

    def to_json(self) -> dict[str, Any]:
        """As a dict."""
        return asdict(self)


NOT_TOKEN_SETTINGS = frozenset({"output_url", "workers", "batch_documents", "expectations"})
"""Settings of data.prepare that cannot change a token (where the dataset goes, how fast it is made, how it is
judged); every other setting is part of the dataset's key."""
PIPELINE_VERSION = 1
"""Bump when reading, cleaning, splitting or encoding code changes the tokens: every dataset gets a new key."""


def dataset_key(cfg: PrepareConfig, files: list[SourceFile], tokenizer_fingerprint: str | None) -> str:
    """Content address of the dataset: inputs, settings that shape the tokens, tokenizer, code that makes them."""
    shaping = cfg.model_dump(exclude=set(NOT_TOKEN_SETTINGS))
    material = {
        "format_version": FORMAT_VERSION,
        "settings": shaping,
        "inputs": [f.fingerprint for f in files],
        "builtin": _builtin_fingerprint(cfg),
        "tokenizer": tokenizer_fingerprint,
        "code": _code_fingerprint(cfg),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def _code_fingerprint(cfg: PrepareConfig) -> dict[str, Any]:
    """The versions of the code behind the tokens: this pipeline, the Unicode tables (normalisation), the
    `tokenizers` library (BPE training and encoding) and `datasketch` (near-duplicate removal)."""
    code: dict[str, Any] = {"pipeline": PIPELINE_VERSION}
    if cfg.cleaning.unicode_normalization is not None:
        import unicodedata

        code["unicode"] = unicodedata.unidata_version
    if cfg.tokenizer.kind == "bpe":
        import importlib.metadata

        code["tokenizers"] = importlib.metadata.version("tokenizers")
    if cfg.cleaning.near_dup is not None:
        import importlib.metadata

        code["datasketch"] = importlib.metadata.version("datasketch")
    return code


def _builtin_fingerprint(cfg: PrepareConfig) -> str | None:
    if cfg.builtin_corpus is None:
        return None
    import sys

    return f"{cfg.builtin_corpus}:python{sys.version_info[0]}.{sys.version_info[1]}:{cfg.builtin_max_bytes}"


class _Staging:
    """Cleaned documents per split in local JSON-lines files (read twice: BPE training, then tokenizing)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tdeploy-prepare-"))
        self.counts: dict[str, int] = {}
        self._files: dict[str, Any] = {}

    def add(self, split: str, text: str) -> None:
        handle = self._files.get(split)
        if handle is None:
            handle = self._files[split] = open(self.dir / f"{split}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        handle.write(json.dumps(text) + "\n")
        self.counts[split] = self.counts.get(split, 0) + 1

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()

    def texts(self, split: str) -> Iterator[str]:
        path = self.dir / f"{split}.jsonl"
        if not path.exists():
            return
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                yield json.loads(line)

    def batches(self, size: int) -> Iterator[tuple[str, list[str]]]:
        """(split, texts) in batches of `size`, split by split."""
        for split in sorted(self.counts):
            for batch in _batches(self.texts(split), size):
                yield split, batch

    def remove(self) -> None:
        for handle in self._files.values():
            with contextlib.suppress(OSError):  # a full disk fails the flush again; the files go anyway
                handle.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _split_documents(
    cfg: PrepareConfig, files: list[SourceFile], storage: StorageConfig, stats: CleaningStats, progress: Progress | None
) -> Iterator[tuple[str, str]]:
    """(split, text) of every document that survives cleaning, in corpus order."""
    documents = cleaned_with_digests(iter_documents(cfg, files, storage), cfg.cleaning, stats)
    for n, (text, digest) in enumerate(documents, start=1):
        yield split_of_digest(digest, cfg.val_fraction), text
        if progress and n % 1000 == 0:
            progress("read+clean", n, None)


def _split_batches(documents: Iterable[tuple[str, str]], size: int) -> Iterator[tuple[str, list[str]]]:
    """(split, texts) in batches of `size` per split, each split's documents in corpus order."""
    open_batches: dict[str, list[str]] = {}
    for split, text in documents:
        batch = open_batches.setdefault(split, [])
        batch.append(text)
        if len(batch) == size:
            yield split, batch
            open_batches[split] = []
    for split in sorted(open_batches):
        if open_batches[split]:
            yield split, open_batches[split]


def _write_tokens(
    cfg: PrepareConfig,
    tokenizer: TextTokenizer,
    batches: Iterable[tuple[str, list[str]]],
    writer: DatasetWriter,
    progress: Progress | None,
    total: int | None = None,
) -> None:
    """Encode the batches on cfg.workers threads (one per core when None) and write each split's documents in
    the order given.

    The shards depend on each split's order only: a split's documents may arrive interleaved with another's.
    """
    done = 0
    with tokenizer.encoder(encode_threads(cfg.workers), writer.dtype) as encoder:
        for split, encoded in encoder.encode(batches):
            writer.add_documents(split, encoded.documents())
            done += len(encoded)
            if progress:
                progress("tokenize", done, total)


def _given_tokenizer(cfg: PrepareConfig, storage: StorageConfig) -> TextTokenizer | None:
    """The tokenizer file data.prepare.tokenizer.path names (None: bytes, or one trained on the data)."""
    if cfg.tokenizer.kind == "bytes" or not cfg.tokenizer.path:
        return None
    return load_tokenizer(cfg.tokenizer.path, cfg.tokenizer, storage)


def reused_tokenizer_problems(
    cfg: PrepareConfig, url: str, storage: StorageConfig, given: TextTokenizer | None
) -> list[DataProblem]:
    """A finished dataset found under the key, against the tokenizer data.prepare asks for.

    The manifest's kind, vocab_size and EOS (and sha256, for a given tokenizer file) must be the spec's, and
    the dataset's tokenizer.json must be the file the manifest names, with the spec's EOS token in it.
    """
    tok = cfg.tokenizer
    if tok.kind == "bytes":
        expected = TokenizerExpectation("data.prepare.tokenizer", "bytes", BYTE_EOS + 1, None, BYTE_EOS)
    elif given is not None:
        expected = TokenizerExpectation("data.prepare.tokenizer", "bpe", given.vocab_size, given.sha256, given.eos_id)
    else:
        expected = TokenizerExpectation("data.prepare.tokenizer", "bpe", tok.vocab_size)
    manifest = read_manifest(url, storage)
    problems = tokenizer_problems(url, manifest, expected, storage)
    if problems or manifest.tokenizer.path is None:
        return problems
    fs, root = filesystem(url, storage)
    try:
        own = TextTokenizer("bpe", fs.cat_file(join(root, manifest.tokenizer.path)).decode()).with_eos(tok.eos_token)
    except Exception as err:  # noqa: BLE001 - a file the tokenizers library cannot load is the finding
        return [DataProblem(manifest.tokenizer.path, f"{manifest.tokenizer.path} is not a usable tokenizer: {err}",
                            "rebuild the dataset (remove the folder)")]  # fmt: skip
    if (own.vocab_size, own.eos_id) != (manifest.vocab_size, manifest.eos_id):
        problems.append(
            DataProblem(
                manifest.tokenizer.path,
                f"{manifest.tokenizer.path} has vocab_size={own.vocab_size} and EOS id {own.eos_id} "
                f"({tok.eos_token}), the manifest says {manifest.vocab_size} and {manifest.eos_id}",
                "rebuild the dataset (remove the folder)",
            )
        )
    return problems


def _validate_dataset(
    cfg: PrepareConfig, url: str, storage: StorageConfig, runner: Any, document_report: tuple[int, list] | None
) -> Any:
    from validation.data import SuiteReport, run_dataset_suite

    suite = run_dataset_suite(runner, url, cfg.expectations, cfg.shard_tokens, storage)
    evaluated, failed = suite.evaluated, suite.failed
    if document_report:
        evaluated += document_report[0]
        failed = document_report[1] + failed
    success = not failed and not suite.problems
    return SuiteReport(success=success, evaluated=evaluated, failed=failed, problems=suite.problems)


def publish_validation(
    dataset_url: str, folder_url: str, storage: StorageConfig, report: Any, runner: Any, manifest: DatasetManifest
) -> tuple[str, str]:
    """Write validation.json, the offline report and GE's Data Docs of `dataset_url` under `folder_url`
    (the dataset's own folder on the prepare path, the deployment's reports for a dataset given by URL).

    Returns the URLs of validation.json and of the offline report's index.
    """
    from validation.data_report import INDEX, ReportContext, render_pages

    fs, root = filesystem(folder_url, storage)
    report_path = join(root, VALIDATION_FILE)
    write_bytes_atomic(fs, report_path, json.dumps(report.to_json(), indent=2, default=str).encode())
    docs_local = runner.build_docs()
    docs_path = join(root, DATA_DOCS_DIR)
    fs.put(docs_local.rstrip("/") + "/", docs_path, recursive=True)
    context = ReportContext(
        dataset_url=dataset_url,
        splits={name: {"docs": s.n_docs, "tokens": s.n_tokens} for name, s in manifest.splits.items()},
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        ge_docs_href=f"{relpath(DATA_DOCS_DIR, REPORT_DIR)}/index.html",
        problems=list(report.problems),
    )
    pages_path = join(root, REPORT_DIR)
    for name, page in render_pages(runner.runs, context).items():
        write_bytes_atomic(fs, join(pages_path, name), page.encode())
    prefix = f"{folder_url.split('://', 1)[0]}://" if "://" in folder_url else ""
    return prefix + report_path, prefix + join(pages_path, INDEX)


def prepare_dataset(
    cfg: PrepareConfig, storage: StorageConfig, progress: Progress | None = None, validate: bool = True
) -> PrepareResult:
    """Prepare (or reuse) the dataset the config describes; raises UserError / TransientError / DataValidationError."""
    with unreachable_storage_is_transient(f"data.prepare.output_url={cfg.output_url}"):
        return _prepare(cfg, storage, progress, validate)


@contextlib.contextmanager
def unreachable_storage_is_transient(where: str) -> Iterator[None]:
    """A connection error from the storage under `where` (a spec field and its value) as a TransientError the
    step retries; user errors and everything else pass unchanged (the text and the image data steps)."""
    try:
        yield
    except (UserError, TransientError):
        raise
    except Exception as err:
        if is_connection_error(err):
            raise TransientError(
                f"{where}: storage unreachable: {err}",
                "check the endpoint (storage.s3_endpoint_url) and network; the step retries",
            ) from err
        raise


def _prepare(cfg: PrepareConfig, storage: StorageConfig, progress: Progress | None, validate: bool) -> PrepareResult:
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    files = expand_sources(cfg.sources, storage)
    given = _given_tokenizer(cfg, storage)
    key = dataset_key(cfg, files, given.sha256 if given else None)
    url = join(cfg.output_url, key)
    fs, root = filesystem(url, storage)
    seconds["inputs"] = time.perf_counter() - started

    runner = None
    if validate:
        from validation.data import SuiteRunner

        t0 = time.perf_counter()
        runner = SuiteRunner()
        seconds["validate_setup"] = time.perf_counter() - t0
    try:
        if fs.exists(join(root, MANIFEST)):
            log.info("reusing the finished dataset %s (same inputs and settings)", url)
            problems = reused_tokenizer_problems(cfg, url, storage, given)
            if problems:
                _reject(fs, root)
                raise DataValidationError(
                    f"dataset {url} (reused from the store)", [], None, problems=problems,
                    fix=f"its manifest was moved to {REJECTED_MANIFEST}: the next run rebuilds it",
                )  # fmt: skip
            stats = json.loads(read_control_file(fs, join(root, PREPARE_FILE)))
            return _finish(cfg, url, storage, runner, None, stats["cleaning"], True, seconds, started)
        document_report, cleaning = _build(cfg, storage, files, key, url, runner, progress, seconds, given)
        return _finish(cfg, url, storage, runner, document_report, cleaning, False, seconds, started)
    finally:
        if runner is not None:
            runner.close()  # the local Data Docs were copied next to the dataset, or the step failed


def _build(
    cfg: PrepareConfig,
    storage: StorageConfig,
    files: list[SourceFile],
    key: str,
    url: str,
    runner: Any,
    progress: Progress | None,
    seconds: dict[str, float],
    given: TextTokenizer | None,
) -> tuple[Any, dict[str, Any]]:
    """Write the dataset at `url`: returns the document suite's report and the cleaning counts.

    On failure nothing is left behind: the local staging folder goes, and so does a dataset folder that was
    begun but not committed (in one pass the shards are written before the document suite has seen every
    document; a suite that fails removes them).
    """
    fs, root = filesystem(url, storage)
    stats = CleaningStats()
    documents = _split_documents(cfg, files, storage, stats, progress)
    staging = None
    writing = False
    try:
        t0 = time.perf_counter()
        document_report = None
        if cfg.tokenizer.kind == "bytes":
            tokenizer = TextTokenizer("bytes")
        elif given is not None:
            tokenizer = given
        else:  # a BPE trained on the training split: stage the documents, train, then encode them
            staging = _Staging()
            for split, text in documents:
                staging.add(split, text)
            staging.close()
            seconds["read_clean"] = time.perf_counter() - t0
            document_report = _checked_documents(cfg, stats, runner, seconds)
            t0 = time.perf_counter()
            tokenizer = train_bpe(staging.texts("train"), cfg.tokenizer)
            seconds["tokenizer"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        meta = {"key": key, "sources": [f.url for f in files], "builtin_corpus": cfg.builtin_corpus}
        writer = DatasetWriter(
            url, tokenizer.vocab_size, tokenizer.info(), tokenizer.eos_id, cfg.shard_tokens, storage,
            overwrite=False, meta=meta, dtype=cfg.token_dtype,
        )  # fmt: skip
        writing = True
        if tokenizer.json_text:
            write_bytes_atomic(fs, join(root, TOKENIZER_FILE), tokenizer.json_text.encode())
        if staging is not None:
            _write_tokens(cfg, tokenizer, staging.batches(cfg.batch_documents), writer, progress, stats.kept)
            seconds["tokenize_write"] = time.perf_counter() - t0
        else:
            _write_tokens(cfg, tokenizer, _split_batches(documents, cfg.batch_documents), writer, progress)
            seconds["read_tokenize_write"] = time.perf_counter() - t0
            document_report = _checked_documents(cfg, stats, runner, seconds)
        write_bytes_atomic(fs, join(root, PREPARE_FILE), json.dumps({"cleaning": stats.to_json()}, indent=2).encode())
        writer.close()  # commits manifest.json
        writing = False
    except BaseException as err:
        if writing:
            _remove_uncommitted(fs, root, url)
        if staging is not None:
            staging.remove()  # before the free space is measured
        if isinstance(err, Exception) and is_no_space(err):
            dataset = writing or staging is None
            raise _no_space(url if dataset else str(staging.dir), dataset) from err
        raise
    finally:
        if staging is not None:
            staging.remove()
    return document_report, stats.to_json()


def _no_space(where: str, dataset: bool) -> NoSpaceError:
    """The full disk named: the dataset's folder, or the local folder where documents wait for the BPE training."""
    if dataset:
        return NoSpaceError(where, "the dataset", None, free_bytes(where),
                            "free space there or point data.prepare.output_url at a disk with more room")  # fmt: skip
    return NoSpaceError(
        where, "the staging of the cleaned documents (for the BPE training)", None, free_bytes(where),
        "free space there or set TMPDIR to a local folder with room (about the corpus's size)",
    )  # fmt: skip


def _checked_documents(cfg: PrepareConfig, stats: CleaningStats, runner: Any, seconds: dict[str, float]) -> Any:
    """Refuse a corpus that cleaning emptied, then run the document suite (when validating): its report."""
    if stats.kept == 0:
        raise UserError(
            f"data.prepare: the corpus is empty after cleaning ({stats.read} read, removed: {stats.removed})",
            "check the sources, text_field and cleaning.min_chars / max_chars",
        )
    if runner is None:
        return None
    from validation.data import document_frame, run_document_suite

    t0 = time.perf_counter()
    report = run_document_suite(
        runner, document_frame(stats.rows), cfg.expectations, cfg.cleaning.min_chars, cfg.cleaning.max_chars
    )
    seconds["validate_documents"] = time.perf_counter() - t0
    if report[1]:
        raise DataValidationError("data.prepare (cleaned documents)", report[1], None)
    return report


def _reject(fs: Any, root: str) -> None:
    """Uncommit a finished dataset that failed its checks: the next run with its key builds it anew."""
    fs.mv(join(root, MANIFEST), join(root, REJECTED_MANIFEST))


def _remove_uncommitted(fs: Any, root: str, url: str) -> None:
    """Delete a dataset folder whose manifest was never written; the error being raised stays the one reported."""
    try:
        if fs.exists(root) and not fs.exists(join(root, MANIFEST)):
            fs.rm(root, recursive=True)
    except Exception as err:  # the original failure matters more than the clean-up's
        log.warning("could not remove the unfinished dataset %s: %s", url, err)


def _finish(
    cfg: PrepareConfig,
    url: str,
    storage: StorageConfig,
    runner: Any,
    document_report: Any,
    cleaning: dict[str, Any],
    reused: bool,
    seconds: dict[str, float],
    started: float,
) -> PrepareResult:
    manifest: DatasetManifest = read_manifest(url, storage)
    validation: dict[str, Any] = {"success": None, "skipped": True}
    report_url = docs_url = ""
    if runner is not None:
        t0 = time.perf_counter()
        report = _validate_dataset(cfg, url, storage, runner, document_report)
        report_url, docs_url = publish_validation(url, url, storage, report, runner, manifest)
        validation = report.to_json()
        seconds["validate_dataset"] = time.perf_counter() - t0
        if not report.success:
            _reject(*filesystem(url, storage))
            raise DataValidationError(f"dataset {url}", report.failed, report_url, docs_url, report.problems)
    seconds["total"] = time.perf_counter() - started
    return PrepareResult(
        dataset_url=url,
        key=url.rstrip("/").rsplit("/", 1)[-1],
        reused=reused,
        cleaning=cleaning,
        splits={name: {"docs": s.n_docs, "tokens": s.n_tokens} for name, s in manifest.splits.items()},
        vocab_size=manifest.vocab_size,
        tokenizer_sha256=manifest.tokenizer.sha256,
        validation=validation,
        validation_url=report_url,
        data_docs_url=docs_url,
        seconds=seconds,
    )
