"""The data step's Prefect tasks: `prepare_data` over `prepare_dataset`, `check_dataset` over `check_dataset_url`."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.deployment import DataResult
from tasks.errors import retry_on_transient
from tasks.prepare.config import DataSpec, PrepareConfig
from tasks.prepare.existing import check_dataset_url
from tasks.prepare.pipeline import prepare_dataset
from training.storage import StorageConfig

# Both ways into the data step retry the same: storage outages (TransientError) only, never a bad dataset.
_DATA_STEP = {
    "retries": 3,
    "retry_delay_seconds": [2, 10, 30],
    "retry_condition_fn": retry_on_transient,
    "timeout_seconds": 6 * 3600,
}


@task(name="prepare_data", **_DATA_STEP)
def prepare_data(prepare: PrepareConfig, storage: StorageConfig) -> DataResult:
    """Clean, tokenize, shard and validate the corpus (or reuse the finished dataset); publish the counts."""
    logger = get_run_logger()
    result = prepare_dataset(prepare, storage)
    verb = "reused" if result.reused else "prepared"
    logger.info("%s dataset %s: %s", verb, result.dataset_url, result.splits)
    rows = [{"measure": "documents read", "value": result.cleaning["read"]}]
    rows += [{"measure": f"removed: {rule}", "value": n} for rule, n in result.cleaning["removed"].items()]
    rows += [{"measure": "documents kept", "value": result.cleaning["kept"]}]
    for split, counts in result.splits.items():
        rows += [{"measure": f"{split} documents", "value": counts["docs"]}]
        rows += [{"measure": f"{split} tokens", "value": counts["tokens"]}]
    rows += [
        {"measure": "vocabulary size", "value": result.vocab_size},
        {"measure": "expectations evaluated", "value": result.validation.get("evaluated_expectations")},
        {"measure": "validation", "value": "passed" if result.validation.get("success") else "skipped"},
    ]
    create_table_artifact(key="prepare-data", table=rows, description=f"{verb} {result.dataset_url}")
    create_markdown_artifact(
        key="prepare-data-validation",
        markdown=(
            f"# Data validation of `{result.dataset_url}`\n\n"
            f"- result: **{'passed' if result.validation.get('success') else 'skipped'}**\n"
            f"- report: `{result.validation_url}`\n"
            f"- Data Docs (offline pages): [{result.data_docs_url}]({result.data_docs_url})\n"
        ),
        description="Great Expectations suites of the prepared dataset",
    )
    return DataResult.of(result)


@task(name="check_dataset", **_DATA_STEP)
def check_dataset(data: DataSpec, vocab_size: int, storage: StorageConfig, reports_dir: str) -> DataResult:
    """Run the token suite over the dataset of data.dataset_url (or reuse the verdict of an identical check)."""
    logger = get_run_logger()
    checked = check_dataset_url(data, vocab_size, storage, reports_dir)
    verdict = "passed (cached verdict)" if checked.cached else "passed"
    logger.info("dataset %s: token suite %s: %s", checked.dataset_url, verdict, checked.splits)
    rows = [{"measure": f"{split} {what}", "value": counts[what]} for split, counts in checked.splits.items()
            for what in ("docs", "tokens")]  # fmt: skip
    rows += [{"measure": f"adopted source {n}", "value": url} for n, url in enumerate(checked.sources)]
    rows += [
        {"measure": "vocabulary size", "value": checked.vocab_size},
        {"measure": "expectations evaluated", "value": checked.validation.get("evaluated_expectations")},
        {"measure": "validation", "value": verdict},
    ]
    create_table_artifact(key="prepare-data", table=rows, description=f"checked {checked.dataset_url}")
    create_markdown_artifact(
        key="prepare-data-validation",
        markdown=(
            f"# Data validation of `{checked.dataset_url}`\n\n"
            f"- result: **{verdict}**\n"
            f"- report: `{checked.validation_url}`\n"
            f"- Data Docs (offline pages): [{checked.data_docs_url}]({checked.data_docs_url})\n"
        ),
        description="Great Expectations dataset suite of the dataset given by URL",
    )
    return DataResult.of_checked(checked)
