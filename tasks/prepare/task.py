"""Prefect task `prepare_data`: thin wrapper over `prepare_dataset`."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.deployment import DataResult
from tasks.errors import retry_on_transient
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from training.storage import StorageConfig


@task(
    name="prepare_data",
    retries=3,
    retry_delay_seconds=[2, 10, 30],
    retry_condition_fn=retry_on_transient,
    timeout_seconds=6 * 3600,
)
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
