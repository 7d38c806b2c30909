"""The data step's Prefect tasks over its `run`: `prepare_data` (data.prepare, cached by the flows) and
`check_dataset` (the spec's own dataset)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.errors import retry_on_transient
from tasks.prepare.step import ARTIFACT, VALIDATION_ARTIFACT, DataInputs, DataResult, run

# Both ways into the data step retry the same: storage outages (TransientError) only, never a bad dataset.
_DATA_STEP = {
    "retries": 3,
    "retry_delay_seconds": [2, 10, 30],
    "retry_condition_fn": retry_on_transient,
    "timeout_seconds": 6 * 3600,
}


def publish(result: DataResult) -> None:
    """Log the dataset's counts; publish them and its validation."""
    if result.given:
        _publish_checked(result)
    else:
        _publish_prepared(result)


def _publish_prepared(result: DataResult) -> None:
    verb = "reused" if result.reused else "prepared"
    get_run_logger().info("%s dataset %s: %s", verb, result.dataset_url, result.splits)
    rows = [{"measure": "documents read", "value": result.cleaning["read"]}]
    rows += [{"measure": f"removed: {rule}", "value": n} for rule, n in result.cleaning["removed"].items()]
    rows += [{"measure": "documents kept", "value": result.cleaning["kept"]}]
    names = {"docs": "documents"}
    for split, counts in result.splits.items():
        rows += [{"measure": f"{split} {names.get(what, what)}", "value": n} for what, n in counts.items()]
    rows += [
        {"measure": "vocabulary size", "value": result.vocab_size},
        {"measure": "expectations evaluated", "value": result.validation.get("evaluated_expectations")},
        {"measure": "validation", "value": "passed" if result.validation.get("success") else "skipped"},
    ]
    create_table_artifact(key=ARTIFACT, table=rows, description=f"{verb} {result.dataset_url}")
    create_markdown_artifact(
        key=VALIDATION_ARTIFACT,
        markdown=(
            f"# Data validation of `{result.dataset_url}`\n\n"
            f"- result: **{'passed' if result.validation.get('success') else 'skipped'}**\n"
            f"- report: `{result.validation_url}`\n"
            f"- Data Docs (offline pages): [{result.data_docs_url}]({result.data_docs_url})\n"
        ),
        description="Great Expectations suites of the prepared dataset",
    )


def _publish_checked(result: DataResult) -> None:
    verdict = "passed (cached verdict)" if result.cached_verdict else "passed"
    get_run_logger().info("dataset %s: token suite %s: %s", result.dataset_url, verdict, result.splits)
    rows = [{"measure": f"{split} {what}", "value": counts[what]} for split, counts in result.splits.items()
            for what in ("docs", "tokens")]  # fmt: skip
    rows += [{"measure": f"adopted source {n}", "value": url} for n, url in enumerate(result.sources)]
    rows += [
        {"measure": "vocabulary size", "value": result.vocab_size},
        {"measure": "expectations evaluated", "value": result.validation.get("evaluated_expectations")},
        {"measure": "validation", "value": verdict},
    ]
    create_table_artifact(key=ARTIFACT, table=rows, description=f"checked {result.dataset_url}")
    create_markdown_artifact(
        key=VALIDATION_ARTIFACT,
        markdown=(
            f"# Data validation of `{result.dataset_url}`\n\n"
            f"- result: **{verdict}**\n"
            f"- report: `{result.validation_url}`\n"
            f"- Data Docs (offline pages): [{result.data_docs_url}]({result.data_docs_url})\n"
        ),
        description="Great Expectations dataset suite of the dataset given by URL",
    )


@task(name="prepare_data", **_DATA_STEP)
def prepare_data(inputs: DataInputs) -> DataResult:
    """Clean, tokenize, shard and validate the corpus (or reuse the finished dataset); publish the counts."""
    assert inputs.prepare is not None, "the spec's own dataset is check_dataset's"
    return run(inputs, publish)


@task(name="check_dataset", **_DATA_STEP)
def check_dataset(inputs: DataInputs) -> DataResult:
    """Run the token suite over the dataset of data.dataset_url (or reuse the verdict of an identical check)."""
    assert inputs.prepare is None, "data.prepare is prepare_data's"
    return run(inputs, publish)
