"""Prefect tasks `run_acceptance` and `run_drills`: the acceptance and drills steps' `run`s, publishing the reports."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.acceptance import step
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.report import table_rows
from tasks.acceptance.step import ARTIFACT, DRILLS_ARTIFACT, AcceptanceResult, AcceptanceStepInputs, DrillsInputs
from tasks.errors import retry_on_transient


def publish(report: AcceptanceReport, files: dict[str, str | None]) -> None:
    """Log the plan beside the run and the ledger entry; publish the acceptance table; log each row."""
    logger = get_run_logger()
    if report.plan_accuracy is not None:
        logger.info("%s", report.plan_accuracy.line())
    if report.ledger_entry:
        logger.info("recorded ledger entry %s: the current baseline now", report.ledger_entry)
    create_table_artifact(key=ARTIFACT, table=table_rows(report), description=f"verdict: {report.to_json()['verdict']}")
    for row in table_rows(report):
        logger.info("%s: %s %s", row["check"], row["verdict"], row["look first"])


def publish_drills(report: AcceptanceReport, files: dict[str, str | None]) -> None:
    """Publish the drills' table."""
    table = table_rows(report)
    create_table_artifact(key=DRILLS_ARTIFACT, table=table, description=f"verdict: {report.to_json()['verdict']}")


def log_drill(result: DrillResult) -> None:
    """Log one drill's outcome as it finishes."""
    get_run_logger().info("drill %s: %s %s", result.name, result.passed, result.message)


@task(name="run_acceptance", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def run_acceptance(inputs: AcceptanceStepInputs) -> AcceptanceResult:
    """Run the acceptance suite in `inputs.mode` in the fresh run workspace `inputs.root`, against the ledger's
    current baseline; fails when any dimension fails (the regression gate included). An accepted run is recorded
    in the ledger with its provenance, its measured memory and step time beside the capacity plan's."""
    return step.run(inputs, publish)


@task(name="run_drills", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def run_drills(inputs: DrillsInputs) -> AcceptanceResult:
    """Run the checkpoint-restore drills under `inputs.root`/drills of a run workspace (the acceptance step's, or
    a new one); fails when a drill fails."""
    return step.run_drills(inputs, publish_drills, log_drill)
