"""Great Expectations suites that gate a dataset: (a) the cleaned documents, (b) the tokenized dataset.

Plain functions over dataframes and dataset files; no Prefect. Great Expectations
is imported only when a suite runs (the import takes seconds).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

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

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form for validation.json."""
        return {
            "success": self.success,
            "evaluated_expectations": self.evaluated,
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
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
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


def document_expectations(gx: Any, limits: DataExpectations, min_chars: int, max_chars: int | None) -> list[Any]:
    """Suite (a) on one row per document read: flags per cleaning rule, `kept`, and cleaned length."""
    from great_expectations.expectations.row_conditions import Column

    e = gx.expectations
    return [
        e.ExpectColumnMeanToBeBetween(column="is_duplicate", max_value=limits.max_duplicate_fraction),
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


def dataset_expectations(gx: Any, vocab_size: int, max_shard_tokens: int, limits: DataExpectations) -> dict[str, list]:
    """Suite (b): one list of expectations per table of `dataset_tables`."""
    from great_expectations.expectations.row_conditions import Column

    e = gx.expectations
    return {
        "dataset_documents": [
            e.ExpectColumnValuesToBeBetween(column="min_id", min_value=0),
            e.ExpectColumnValuesToBeBetween(column="max_id", max_value=vocab_size - 1),
            e.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1),
            e.ExpectColumnValuesToBeInSet(column="in_several_splits", value_set=[False]),
        ],
        "dataset_shards": [
            e.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1, max_value=max_shard_tokens),
            e.ExpectColumnValuesToBeInSet(column="bytes_match", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="tokens_sha256_match", value_set=[True]),
            e.ExpectColumnValuesToBeInSet(column="index_sha256_match", value_set=[True]),
        ],
        "dataset_splits": [
            e.ExpectColumnPairValuesToBeEqual(column_A="manifest_tokens", column_B="counted_tokens"),
            e.ExpectColumnPairValuesToBeEqual(column_A="manifest_docs", column_B="counted_docs"),
            e.ExpectColumnValuesToBeBetween(
                column="counted_docs",
                min_value=limits.min_val_documents,
                row_condition=Column("split") == "val",
            ),
        ],
    }


def run_dataset_suite(
    runner: SuiteRunner, url: str, limits: DataExpectations, shard_tokens: int, storage: Any = None
) -> tuple[int, list[FailedExpectation]]:
    """Suite (b): the tokenized dataset at `url` against its manifest, written with `shard_tokens` per shard.

    A shard is closed once it reaches shard_tokens, so it holds fewer than shard_tokens plus its
    last document and EOS.
    """
    tables = dataset_tables(url, storage)
    manifest = tables["manifest"]
    longest = int(tables["documents"]["n_tokens"].max()) if len(tables["documents"]) else 0
    suites = dataset_expectations(runner.gx, manifest.vocab_size, shard_tokens + longest + 1, limits)
    evaluated, failed = 0, []
    for name, expectations in suites.items():
        n, bad = runner.run(name, tables[name.removeprefix("dataset_")], expectations)
        evaluated += n
        failed.extend(bad)
    return evaluated, failed


def dataset_tables(url: str, storage: Any = None) -> dict[str, Any]:
    """Per-document, per-shard and per-split tables of a written dataset, for suite (b)."""
    import numpy as np
    import pandas as pd

    from training.dataset import read_manifest
    from training.storage import filesystem, join

    manifest = read_manifest(url, storage)
    fs, root = filesystem(url, storage)
    itemsize = np.dtype(manifest.dtype).itemsize
    docs, shards, splits = [], [], []
    for split_name, split in manifest.splits.items():
        counted_tokens = counted_docs = 0
        for number, shard in enumerate(split.shards):
            tokens_path, index_path = join(root, shard.tokens), join(root, shard.index)
            raw = fs.cat_file(tokens_path)
            index_raw = fs.cat_file(index_path)
            shards.append(
                {
                    "split": split_name,
                    "shard": number,
                    "n_tokens": len(raw) // itemsize,
                    "bytes_match": len(raw) == shard.n_tokens * itemsize,
                    "tokens_sha256_match": hashlib.sha256(raw).hexdigest() == shard.tokens_sha256,
                    "index_sha256_match": hashlib.sha256(index_raw).hexdigest() == shard.index_sha256,
                }
            )
            ids = np.frombuffer(raw, dtype=np.dtype(manifest.dtype).newbyteorder("<")).astype(np.int64)
            starts = np.frombuffer(index_raw, dtype="<i8")
            counted_tokens += ids.size
            counted_docs += max(0, starts.size - 1)
            for begin, end in zip(starts[:-1], starts[1:], strict=True):
                body = ids[begin:end]
                if manifest.eos_id is not None and body.size and body[-1] == manifest.eos_id:
                    body = body[:-1]
                docs.append(
                    {
                        "split": split_name,
                        "n_tokens": int(body.size),
                        "min_id": int(body.min()) if body.size else 0,
                        "max_id": int(body.max()) if body.size else 0,
                        "doc_hash": hashlib.sha256(body.tobytes()).hexdigest(),
                    }
                )
        splits.append(
            {
                "split": split_name,
                "manifest_tokens": split.n_tokens,
                "counted_tokens": counted_tokens,
                "manifest_docs": split.n_docs,
                "counted_docs": counted_docs,
            }
        )
    doc_frame = pd.DataFrame(docs)
    per_split = doc_frame.groupby("doc_hash")["split"].nunique()
    doc_frame["in_several_splits"] = doc_frame["doc_hash"].map(per_split) > 1
    return {
        "manifest": manifest,
        "documents": doc_frame,
        "shards": pd.DataFrame(shards),
        "splits": pd.DataFrame(splits),
    }
