"""Great Expectations suites that gate a dataset: (a) the cleaned documents, (b) the tokenized dataset.

Plain functions over dataframes and dataset files; no Prefect. Great Expectations
is imported only when a suite runs (the import takes seconds).

Suite (b) runs on tables built by streaming every shard once (`scan_shard`: sha256,
id range, first out-of-range id, index offsets), so a dataset of any size is checked
in bounded memory; the per-document table (duplicates across splits, empty documents)
is built only where the dataset was just written (`documents=True`, the prepare path).
Each defect is also reported as a `DataProblem` that names the file, the value and the fix.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from pydantic import Field

from training.config import StrictModel


class DataExpectations(StrictModel):
    """Thresholds of the data suites."""

    max_duplicate_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Most documents that may be exact duplicates of earlier ones.",
    )
    max_near_duplicate_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description=(
            "Most documents that may be near-duplicates of earlier kept ones (cleaning.near_dup; 0 while it is "
            "off; exact copies count as duplicates)."
        ),
    )
    max_invalid_utf8_fraction: float = Field(
        default=0.01, ge=0, le=1, allow_inf_nan=False, description="Most documents that may contain invalid UTF-8."
    )
    max_dropped_fraction: float = Field(
        default=0.9,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Most documents that cleaning may drop (empty, short, long).",
    )
    min_documents: int = Field(default=10, ge=1, le=10**12, description="Fewest documents that must survive cleaning.")
    min_val_documents: int = Field(default=1, ge=0, le=10**12, description="Fewest documents in the validation split.")


@dataclass
class FailedExpectation:
    """One expectation that did not hold, with what was observed."""

    suite: str
    expectation: str
    column: str | None
    kwargs: dict[str, Any]
    observed: Any

    def describe(self) -> str:
        """`suite: expectation(column) observed ...` in one line."""
        column = f"({self.column})" if self.column else ""
        return f"{self.suite}: {self.expectation}{column} failed; observed {self.observed}"


@dataclass
class ExpectationOutcome:
    """One expectation as evaluated: what it asked, what was observed, and whether it held."""

    expectation: str
    column: str | None
    kwargs: dict[str, Any]
    observed: Any
    success: bool


@dataclass
class SuiteRun:
    """One validation: a suite run on one table, with its rows per dataset split and its time (UTC, ISO 8601)."""

    suite: str
    rows_per_split: dict[str, int]
    run_time: str
    outcomes: list[ExpectationOutcome]

    @property
    def success(self) -> bool:
        """Every expectation held."""
        return all(o.success for o in self.outcomes)

    @property
    def failed(self) -> list[FailedExpectation]:
        """The expectations that did not hold."""
        return [
            FailedExpectation(self.suite, o.expectation, o.column, o.kwargs, o.observed)
            for o in self.outcomes
            if not o.success
        ]


@dataclass
class SuiteReport:
    """Outcome of the suites that ran."""

    success: bool
    evaluated: int
    failed: list[FailedExpectation] = field(default_factory=list)
    data_docs_dir: str | None = None
    problems: list[DataProblem] = field(default_factory=list)
    """Each defect found, with its file, value and fix (the failed expectations say which rule it broke)."""

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form for validation.json."""
        return {
            "success": self.success,
            "evaluated_expectations": self.evaluated,
            "problems": [p.to_json() for p in self.problems],
            "failed": [
                {
                    "suite": f.suite,
                    "expectation": f.expectation,
                    "column": f.column,
                    "kwargs": f.kwargs,
                    "observed": f.observed,
                }
                for f in self.failed
            ],
        }


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _outcome(item: Any) -> ExpectationOutcome:
    """Our record of one GE expectation result; `observed` is the observed value or the unexpected counts."""
    config = item.expectation_config
    kwargs = {k: _jsonable(v) for k, v in config.kwargs.items() if k != "batch_id"}
    observed = item.result.get("observed_value")
    if observed is None:
        observed = {
            "unexpected_count": item.result.get("unexpected_count"),
            "element_count": item.result.get("element_count"),
            "examples": item.result.get("partial_unexpected_list", [])[:5],
        }
    return ExpectationOutcome(config.type, kwargs.get("column"), kwargs, _jsonable(observed), bool(item.success))


def _rows_per_split(dataframe: Any) -> dict[str, int]:
    """Rows of the validated table per dataset split; `all` for a table read before the split."""
    if "split" not in dataframe.columns:
        return {"all": len(dataframe)}
    return {str(k): int(v) for k, v in dataframe["split"].value_counts(sort=False).sort_index().items()}


class SuiteRunner:
    """One ephemeral Great Expectations context; suites are registered once and run with new dataframes.

    Without `docs_dir` the Data Docs are rendered into a temporary folder that `close()` (or leaving
    the `with` block) removes: copy them out first (`build_docs()` returns the folder).
    """

    def __init__(self, docs_dir: str | None = None) -> None:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        import great_expectations as gx

        from validation.data_docs_views import site_views

        self.gx = gx
        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = {"globally": False}
        self._owns_docs_dir = docs_dir is None
        self.docs_dir = docs_dir or tempfile.mkdtemp(prefix="tdeploy-datadocs-")
        self.context.add_data_docs_site(
            site_name="tdeploy",
            site_config={
                "class_name": "SiteBuilder",
                "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": self.docs_dir},
                **site_views(),
            },
        )
        self.source = self.context.data_sources.add_pandas("tdeploy")
        self._definitions: dict[str, Any] = {}
        self.runs: list[SuiteRun] = []
        """Every validation run so far, in order (the offline report renders these)."""

    def run(self, name: str, dataframe: Any, expectations: list[Any]) -> tuple[int, list[FailedExpectation]]:
        """Run suite `name` on `dataframe`; each distinct set of expectations gets its own suite."""
        configs = repr([e.configuration.to_json_dict() for e in expectations])
        signature = hashlib.sha256(configs.encode()).hexdigest()[:10]
        key = f"{name}-{signature}"
        definition = self._definitions.get(key)
        if definition is None:
            asset = self.source.add_dataframe_asset(key)
            batch = asset.add_batch_definition_whole_dataframe(f"{key}-all")
            suite = self.context.suites.add(self.gx.ExpectationSuite(name=key))
            for expectation in expectations:
                suite.add_expectation(expectation)
            definition = self.context.validation_definitions.add(
                self.gx.ValidationDefinition(name=key, data=batch, suite=suite)
            )
            self._definitions[key] = definition
        run_time = datetime.now(UTC).isoformat(timespec="seconds")
        result = definition.run(batch_parameters={"dataframe": dataframe})
        outcomes = [_outcome(item) for item in result.results]
        run = SuiteRun(name, _rows_per_split(dataframe), run_time, outcomes)
        self.runs.append(run)
        return len(outcomes), run.failed

    def build_docs(self) -> str:
        """Render the Data Docs site of every suite run so far; returns its folder."""
        self.context.build_data_docs(site_names=["tdeploy"])
        return self.docs_dir

    def close(self) -> None:
        """Remove the temporary Data Docs folder (a folder given as docs_dir is left alone)."""
        if self._owns_docs_dir:
            shutil.rmtree(self.docs_dir, ignore_errors=True)

    def __enter__(self) -> SuiteRunner:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()


DOCUMENT_COLUMNS = ("n_chars", "invalid_utf8", "is_duplicate", "dropped", "kept", "is_near_duplicate")
"""Suite (a)'s table: one row per document read (tasks/prepare/clean.py's CleaningStats.rows)."""


def document_frame(rows: list[tuple[int, bool, bool, bool, bool, bool]]) -> Any:
    """Suite (a)'s table from one (n_chars, invalid_utf8, is_duplicate, dropped, kept, is_near_duplicate) tuple
    per document read."""
    import pandas as pd

    return pd.DataFrame(rows, columns=list(DOCUMENT_COLUMNS))


def document_expectations(gx: Any, limits: DataExpectations, min_chars: int, max_chars: int | None) -> list[Any]:
    """Suite (a) on one row per document read: flags per cleaning rule, `kept`, and cleaned length."""
    from great_expectations.expectations.row_conditions import Column

    e = gx.expectations
    return [
        e.ExpectColumnMeanToBeBetween(column="is_duplicate", max_value=limits.max_duplicate_fraction),
        e.ExpectColumnMeanToBeBetween(column="is_near_duplicate", max_value=limits.max_near_duplicate_fraction),
        e.ExpectColumnMeanToBeBetween(column="invalid_utf8", max_value=limits.max_invalid_utf8_fraction),
        e.ExpectColumnMeanToBeBetween(column="dropped", max_value=limits.max_dropped_fraction),
        e.ExpectColumnSumToBeBetween(column="kept", min_value=limits.min_documents),
        e.ExpectColumnValuesToBeBetween(
            column="n_chars",
            min_value=max(1, min_chars),
            max_value=max_chars,
            row_condition=Column("kept") == True,  # noqa: E712 - builds a GE condition
        ),
    ]


def run_document_suite(
    runner: SuiteRunner, rows: Any, limits: DataExpectations, min_chars: int, max_chars: int | None
) -> tuple[int, list[FailedExpectation]]:
    """Suite (a): the cleaned documents."""
    return runner.run("documents", rows, document_expectations(runner.gx, limits, min_chars, max_chars))


SUITE_VERSION = 2
"""Version of the dataset checks: a verdict cached by another version is not reused."""

_CHUNK_BYTES = 8 << 20
_RECOPY = "re-copy the dataset (a transfer cut short?) or rebuild it (tdeploy prepare-data)"
_REPLACED = "the file is corrupt or was replaced; re-copy the dataset or rebuild it (tdeploy prepare-data)"
_REBUILD = "the dataset is inconsistent with its manifest; rebuild it (tdeploy prepare-data)"


@dataclass(frozen=True)
class DataProblem:
    """One defect of a dataset: the file at fault (relative to the dataset root), what is wrong with the value,
    and the fix."""

    file: str | None
    problem: str
    fix: str

    def describe(self) -> str:
        """`problem; fix` in one line."""
        return f"{self.problem}; {self.fix}"

    def to_json(self) -> dict[str, Any]:
        """As a dict (validation.json)."""
        return asdict(self)


@dataclass
class ShardScan:
    """One shard's token and index files as read, beside what the manifest says of them."""

    split: str
    number: int
    info: Any
    """The manifest's entry (training.dataset.ShardInfo)."""
    dtype: str
    unreadable: dict[str, str] = field(default_factory=dict)
    """Per file not read (as the manifest names it): why (missing, or leading outside the dataset root)."""
    tokens_bytes: int | None = None
    index_bytes: int | None = None
    tokens_sha256: str | None = None
    index_sha256: str | None = None
    min_id: int | None = None
    max_id: int | None = None
    first_bad: tuple[int, int] | None = None
    """(position, id) of the first token id at or above the vocabulary limit."""
    index_problem: str | None = None
    counted_docs: int = 0
    counted_range_tokens: int = 0
    """Tokens of the shard's documents, as its index counts them."""

    @property
    def itemsize(self) -> int:
        """Bytes per token id."""
        return np.dtype(self.dtype).itemsize

    @property
    def counted_tokens(self) -> int:
        """Tokens of the shard's documents as its index counts them (0 when the index was not read or is broken)."""
        return self.counted_range_tokens

    @property
    def bytes_match(self) -> bool:
        """Both files have the sizes the manifest records."""
        return self.tokens_bytes == self.info.tokens_bytes and self.index_bytes == self.info.index_bytes

    def row(self) -> dict[str, Any]:
        """The shard's row of the `shards` table."""
        return {
            "split": self.split,
            "shard": self.number,
            "n_tokens": self.counted_tokens,
            "min_id": self.min_id or 0,
            "max_id": -1 if self.max_id is None else self.max_id,
            "bytes_match": self.bytes_match,
            "tokens_sha256_match": self.tokens_sha256 == self.info.tokens_sha256,
            "index_sha256_match": self.index_sha256 == self.info.index_sha256,
            "index_valid": self.index_bytes is not None and self.index_problem is None,
        }


class _Stream:
    """A file read chunk by chunk: its sha256 and size as it goes, and its whole items as arrays."""

    def __init__(self, chunks: Iterable[bytes], dtype: np.dtype) -> None:
        self.chunks, self.dtype = chunks, dtype
        self.digest, self.nbytes = hashlib.sha256(), 0

    def arrays(self) -> Iterator[np.ndarray]:
        rest = b""
        for chunk in self.chunks:
            self.digest.update(chunk)
            self.nbytes += len(chunk)
            data = rest + chunk if rest else chunk
            whole = len(data) - len(data) % self.dtype.itemsize
            if whole:
                yield np.frombuffer(data, dtype=self.dtype, count=whole // self.dtype.itemsize)
            rest = data[whole:]  # a trailing partial item is never decoded: the size check reports it


def _chunks(fs: Any, path: str) -> Iterator[bytes]:
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            yield chunk


def _scan_tokens(scan: ShardScan, stream: _Stream, limit: int) -> None:
    position = 0
    for ids in stream.arrays():
        low, high = int(ids.min()), int(ids.max())
        scan.min_id = low if scan.min_id is None else min(scan.min_id, low)
        scan.max_id = high if scan.max_id is None else max(scan.max_id, high)
        if scan.first_bad is None and high >= limit:
            at = int(np.argmax(ids >= limit))
            scan.first_bad = (position + at, int(ids[at]))
        position += ids.size
    scan.tokens_bytes, scan.tokens_sha256 = stream.nbytes, stream.digest.hexdigest()


def _scan_index(scan: ShardScan, raw: bytes) -> None:
    """Megatron's index, parsed and held against the token file and the manifest's entry (training/indexed.py)."""
    from training.dataset import index_problem
    from training.indexed import IndexFormatError, parse_index

    scan.index_bytes, scan.index_sha256 = len(raw), hashlib.sha256(raw).hexdigest()
    info = scan.info
    if scan.tokens_bytes is not None and scan.tokens_bytes != info.tokens_bytes:
        try:  # the token file's size is reported on its own; count what the index describes
            index = parse_index(raw)
        except IndexFormatError as err:
            scan.index_problem = err.problem
            return
        first, end = info.docs if info.docs is not None else (0, index.n_documents)
        end = min(end, index.n_documents)
        offsets = index.document_offsets()
        scan.counted_docs, scan.counted_range_tokens = max(0, end - first), int(offsets[end] - offsets[min(first, end)])
        return
    scan.index_problem = index_problem(raw, info, scan.dtype)
    if scan.index_problem is None:
        scan.counted_docs, scan.counted_range_tokens = info.n_docs, info.n_tokens


def scan_shard(
    locator: Any,
    split: str,
    number: int,
    info: Any,
    dtype: str,
    limit: int,
    keep_bytes: bool = False,
) -> tuple[ShardScan, tuple[bytes, bytes] | None]:
    """Read one shard's files once: sizes, sha256, id range, the first id >= `limit`, the index against both.

    The token file is streamed in chunks (the index, a small file, is read whole); with `keep_bytes` the token
    file is read whole and returned as well (tokens, index), for the per-document table. The `locator`
    (training.dataset.ShardLocator) refuses files that resolve outside their root.
    """
    from training.dataset import DatasetError

    scan = ShardScan(split, number, info, dtype)
    try:
        found = locator.files(info)
    except DatasetError as err:
        scan.unreadable[err.file or info.tokens] = err.problem
        return scan, None
    paths = {}
    for rel, path, fs, _local, identity in found:
        if identity is None:
            scan.unreadable[rel] = f"{rel} is missing"
        else:
            paths[rel] = (fs, path)
    token_type = np.dtype(dtype).newbyteorder("<")
    kept_tokens = None
    if info.tokens in paths:
        fs, path = paths[info.tokens]
        if keep_bytes:
            kept_tokens = fs.cat_file(path)
            chunks: Iterable[bytes] = [kept_tokens]
        else:
            chunks = _chunks(fs, path)
        _scan_tokens(scan, _Stream(chunks, token_type), limit)
    index_raw = None
    if info.index in paths:
        fs, path = paths[info.index]
        index_raw = fs.cat_file(path)
        _scan_index(scan, index_raw)
    kept = (kept_tokens, index_raw) if kept_tokens is not None and index_raw is not None else None
    return scan, kept


@dataclass
class DatasetTables:
    """A dataset's tables for suite (b), and the shard scans they were made from."""

    manifest: Any
    """The dataset's manifest (training.dataset.DatasetManifest)."""
    limit: int
    """Token ids must be below this: the manifest's vocab_size, or the model's when that is smaller."""
    limit_name: str
    """Where the limit comes from, for messages (`model.vocab_size` or `the manifest's vocab_size`)."""
    scans: list[ShardScan]
    shards: Any
    splits: Any
    documents: Any | None = None
    """One row per document; None where it was not built (`documents=False`)."""

    def table(self, name: str) -> Any:
        """The table of suite part `name` (`documents`, `shards`, `splits`), with the columns the suite reads.

        The documents' hashes stay out of Great Expectations' table: they only find the documents in several
        splits, and 64-character strings in every row make each expectation slower to evaluate.
        """
        if name == "documents":
            return self.documents[["split", "n_tokens", "in_several_splits"]]
        return {"shards": self.shards, "splits": self.splits}[name]


def dataset_tables(
    url: str, storage: Any = None, vocab_size: int | None = None, documents: bool = True, trusted: Any = ()
) -> DatasetTables:
    """Per-shard and per-split tables of a written dataset (and per-document ones with `documents`), for suite (b).

    Every shard is read once: streamed in chunks, or whole (one shard at a time) for the per-document table.
    `vocab_size` is the model's: token ids must also be below it. `trusted`: the adopted sources the spec names.
    """
    import pandas as pd

    from training.dataset import ShardLocator, read_manifest

    manifest = read_manifest(url, storage, trusted)
    locator = ShardLocator(url, storage)
    limit, limit_name = manifest.vocab_size, "the manifest's vocab_size"
    if vocab_size is not None and vocab_size <= manifest.vocab_size:
        limit, limit_name = vocab_size, "model.vocab_size"
    token_type = np.dtype(manifest.dtype).newbyteorder("<")
    docs: list[tuple[str, np.ndarray, list[str]]] = []
    scans, splits = [], []
    for split_name, split in manifest.splits.items():
        counted_tokens = counted_docs = 0
        for number, shard in enumerate(split.shards):
            scan, kept = scan_shard(locator, split_name, number, shard, manifest.dtype, limit, keep_bytes=documents)
            scans.append(scan)
            counted_tokens += scan.counted_tokens
            counted_docs += scan.counted_docs
            if kept is not None and scan.index_problem is None and scan.tokens_bytes == shard.tokens_bytes:
                docs.append((split_name, *_document_columns(kept, shard, token_type, manifest.eos_id)))
        splits.append(
            {
                "split": split_name,
                "manifest_tokens": split.n_tokens,
                "counted_tokens": counted_tokens,
                "manifest_docs": split.n_docs,
                "counted_docs": counted_docs,
            }
        )
    doc_frame = _document_table(docs) if documents else None
    return DatasetTables(
        manifest, limit, limit_name, scans, pd.DataFrame([s.row() for s in scans]), pd.DataFrame(splits), doc_frame
    )


def _document_columns(
    kept: tuple[bytes, bytes], shard: Any, token_type: np.dtype, eos_id: int | None
) -> tuple[np.ndarray, list[str]]:
    """Each document's length and sha256 (hex) in one shard (a checked index), without its trailing EOS."""
    from training.indexed import parse_index

    tokens_raw, index_raw = kept
    index = parse_index(index_raw)
    first, end = shard.docs if shard.docs is not None else (0, index.n_documents)
    offsets = index.document_offsets()[first : end + 1]
    if offsets.size < 2:
        return np.zeros(0, dtype=np.int64), []
    begins, ends = offsets[:-1], offsets[1:]
    if eos_id is not None:
        ids = np.frombuffer(tokens_raw, dtype=token_type)
        ends = ends - ((ends > begins) & (ids[np.maximum(ends - 1, 0)] == eos_id))
    size = token_type.itemsize
    view = memoryview(tokens_raw)
    hashes = [
        hashlib.sha256(view[b * size : e * size]).hexdigest()
        for b, e in zip(begins.tolist(), ends.tolist(), strict=True)
    ]
    return (ends - begins).astype(np.int64), hashes


def _document_table(docs: list[tuple[str, np.ndarray, list[str]]]) -> Any:
    """One row per document (split, n_tokens, doc_hash), flagging documents whose tokens are in several splits."""
    import pandas as pd

    lengths = [n_tokens for _, n_tokens, _ in docs]
    frame = pd.DataFrame(
        {
            "split": np.repeat(np.array([split for split, _, _ in docs], dtype=object), [n.size for n in lengths]),
            "n_tokens": np.concatenate(lengths) if docs else np.zeros(0, dtype=np.int64),
            "doc_hash": [digest for _, _, hashes in docs for digest in hashes],
        }
    )
    hash_codes, _ = pd.factorize(frame["doc_hash"])
    split_codes, split_names = pd.factorize(frame["split"])
    pairs = np.unique(hash_codes.astype(np.int64) * len(split_names) + split_codes)  # distinct (hash, split)
    splits_per_hash = np.bincount(pairs // max(1, len(split_names)), minlength=len(frame))
    frame["in_several_splits"] = splits_per_hash[hash_codes] > 1
    return frame


def dataset_expectations(
    gx: Any,
    vocab_size: int,
    max_shard_tokens: int | None,
    limits: DataExpectations,
    val_split: str = "val",
    documents: bool = True,
) -> dict[str, list]:
    """Suite (b): one list of expectations per table of `dataset_tables` (ids below `vocab_size`)."""
    from great_expectations.expectations.row_conditions import Column

    e = gx.expectations
    suites = {
        "dataset_shards": [
            e.ExpectColumnValuesToBeBetween(column="min_id", min_value=0),
            e.ExpectColumnValuesToBeBetween(column="max_id", max_value=vocab_size - 1),
            e.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1, max_value=max_shard_tokens),
            e.ExpectColumnValuesToBeInSet(column="bytes_match", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="tokens_sha256_match", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="index_sha256_match", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="index_valid", value_set=[True]),
        ],
        "dataset_splits": [
            e.ExpectColumnPairValuesToBeEqual(column_A="manifest_tokens", column_B="counted_tokens"),
            e.ExpectColumnPairValuesToBeEqual(column_A="manifest_docs", column_B="counted_docs"),
            e.ExpectColumnValuesToBeBetween(
                column="counted_docs",
                min_value=limits.min_val_documents,
                row_condition=Column("split") == val_split,
            ),
        ],
    }
    if documents:
        suites = {
            "dataset_documents": [
                e.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1),
                e.ExpectColumnValuesToBeInSet(column="in_several_splits", value_set=[False]),
            ],
            **suites,
        }
    return suites


@dataclass
class DatasetSuiteResult:
    """Suite (b) over one dataset: the expectations' outcome and each defect with its file, value and fix."""

    evaluated: int
    failed: list[FailedExpectation]
    problems: list[DataProblem]
    splits: dict[str, dict[str, int]]
    """Per split: `docs` and `tokens` (from the manifest)."""

    @property
    def success(self) -> bool:
        """Every expectation held and no defect was found."""
        return not self.failed and not self.problems


def run_dataset_suite(
    runner: SuiteRunner,
    url: str,
    limits: DataExpectations,
    shard_tokens: int | None,
    storage: Any = None,
    *,
    vocab_size: int | None = None,
    val_split: str = "val",
    documents: bool = True,
    trusted: Any = (),
) -> DatasetSuiteResult:
    """Suite (b): the tokenized dataset at `url` against its manifest (and the model's `vocab_size`).

    `shard_tokens` is what the dataset was written with (None: unknown, for a dataset made elsewhere): a
    shard is closed once it reaches it, so it holds fewer than shard_tokens plus its last document and EOS.
    """
    tables = dataset_tables(url, storage, vocab_size, documents, trusted)
    manifest = tables.manifest
    max_shard_tokens = None
    if shard_tokens is not None:
        longest = int(tables.documents["n_tokens"].max()) if documents and len(tables.documents) else 0
        max_shard_tokens = shard_tokens + longest + 1
    suites = dataset_expectations(runner.gx, tables.limit, max_shard_tokens, limits, val_split, documents)
    evaluated, failed = 0, []
    for name, expectations in suites.items():
        n, bad = runner.run(name, tables.table(name.removeprefix("dataset_")), expectations)
        evaluated += n
        failed.extend(bad)
    splits = {name: {"docs": s.n_docs, "tokens": s.n_tokens} for name, s in manifest.splits.items()}
    return DatasetSuiteResult(evaluated, failed, table_problems(tables, limits, val_split), splits)


def table_problems(tables: DatasetTables, limits: DataExpectations, val_split: str = "val") -> list[DataProblem]:
    """Every defect the scans found, each naming its file (or split), the value and the fix."""
    problems: list[DataProblem] = []
    for scan in tables.scans:
        problems += _shard_problems(scan, tables.limit, tables.limit_name)
    # their shards' sizes or indexes are named above, and a broken index counts nothing
    uncounted = {scan.split for scan in tables.scans if not scan.bytes_match or scan.index_problem is not None}
    for row in tables.splits.to_dict("records"):
        name = row["split"]
        for what, field_name in (("tokens", "n_tokens"), ("docs", "n_docs")):
            if name not in uncounted and row[f"manifest_{what}"] != row[f"counted_{what}"]:
                problems.append(
                    DataProblem(
                        None,
                        f"split {name}: the manifest says {field_name}={row[f'manifest_{what}']}, its shard files "
                        f"hold {row[f'counted_{what}']}",
                        _REBUILD,
                    )
                )
        if name == val_split and row["counted_docs"] < limits.min_val_documents:
            problems.append(
                DataProblem(
                    None,
                    f"split {name}: {row['counted_docs']} documents, fewer than "
                    f"min_val_documents={limits.min_val_documents}",
                    "use a dataset with a held-out split (data.val_split names it)",
                )
            )
    return problems


def _shard_problems(scan: ShardScan, limit: int, limit_name: str) -> list[DataProblem]:
    """The shard's defects: one row per check (file, finding or None, fix), read by one loop."""
    info = scan.info
    tokens_size, index_size = info.tokens_bytes, info.index_bytes
    tokens_sized = scan.tokens_bytes == tokens_size
    index_sized = scan.index_bytes == index_size

    def size(rel: str, actual: int | None, expected: int, what: str) -> str | None:
        if actual is None or actual == expected:
            return None
        cut = ", truncated" if actual < expected else ""
        return f"{rel} has {actual} bytes, the manifest says {expected} ({what}){cut}"

    checks = [
        (info.tokens, scan.unreadable.get(info.tokens), _RECOPY),
        (info.index, scan.unreadable.get(info.index), _RECOPY),
        (info.tokens, size(info.tokens, scan.tokens_bytes, tokens_size, f"token ids of {scan.dtype}"), _RECOPY),
        (info.index, size(info.index, scan.index_bytes, index_size, "Megatron index"), _RECOPY),
        (
            info.tokens,
            tokens_sized
            and scan.tokens_sha256 != info.tokens_sha256
            and f"{info.tokens} has sha256 {scan.tokens_sha256}, the manifest says {info.tokens_sha256}",
            _REPLACED,
        ),
        (
            info.index,
            index_sized
            and scan.index_sha256 != info.index_sha256
            and f"{info.index} has sha256 {scan.index_sha256}, the manifest says {info.index_sha256}",
            _REPLACED,
        ),
        (
            info.tokens,
            scan.first_bad is not None
            and f"token id {scan.first_bad[1]} at position {scan.first_bad[0]} of {info.tokens} >= "
            f"{limit_name}={limit} (outside the vocabulary)",
            "the ids do not come from a tokenizer of this vocabulary: use a dataset made with the model's "
            "tokenizer, rebuild this one, or set model.vocab_size to the tokenizer's vocabulary",
        ),
        (info.index, scan.index_problem and f"{info.index} {scan.index_problem}", _REBUILD),
    ]
    return [DataProblem(rel, finding, fix) for rel, finding, fix in checks if finding]


@dataclass(frozen=True)
class TokenizerExpectation:
    """What a spec asks of a dataset's tokenizer; None means anything. `source` names the spec's field."""

    source: str
    kind: str | None = None
    vocab_size: int | None = None
    sha256: str | None = None
    eos_id: int | None = None


def tokenizer_problems(
    url: str, manifest: Any, expected: TokenizerExpectation, storage: Any = None
) -> list[DataProblem]:
    """The dataset's tokenizer against the spec: the manifest's kind, vocab_size, EOS and sha256, and the
    sha256 of the tokenizer file the manifest names (it must be there when a sha256 is asked for)."""
    from training.dataset import MANIFEST
    from training.storage import filesystem, join, sha256_file

    tok = manifest.tokenizer
    fix = (
        f"the dataset was made with another tokenizer than {expected.source} asks for: rebuild it (remove the "
        "folder), or point the spec at the dataset made with this tokenizer"
    )
    compared = [
        ("tokenizer.kind", tok.kind, expected.kind),
        ("vocab_size", manifest.vocab_size, expected.vocab_size),
        ("eos_id", manifest.eos_id, expected.eos_id),
        ("tokenizer.sha256", tok.sha256, expected.sha256),
    ]
    problems = [
        DataProblem(MANIFEST, f"{MANIFEST} {name}={have}, {expected.source} asks for {want}", fix)
        for name, have, want in compared
        if want is not None and have != want
    ]
    if tok.path is None:
        if expected.sha256 is not None and tok.kind != "bytes":
            problems.append(
                DataProblem(MANIFEST, f"{MANIFEST} names no tokenizer file", "copy tokenizer.json with the dataset")
            )
        return problems
    fs, root = filesystem(url, storage)
    path = join(root, tok.path)
    if not fs.exists(path):
        return [*problems, DataProblem(tok.path, f"{tok.path} is missing", "copy the tokenizer file with the dataset")]
    actual = sha256_file(fs, path)
    if actual != tok.sha256:
        problems.append(
            DataProblem(
                tok.path,
                f"{tok.path} has sha256 {actual}, the manifest says {tok.sha256} (the file was replaced)",
                "restore the dataset's own tokenizer file, or rebuild the dataset (remove the folder)",
            )
        )
    return problems
