"""Prefect task `check_nodes`: the node-check step's `run`, retried only when nodes were unreachable."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.context import TaskRunContext

from tasks.errors import retry_on_transient
from tasks.nodes.report import NodeReport
from tasks.nodes.step import ARTIFACT, NodesInputs, NodesResult, run


def publish(report: NodeReport, path: Path) -> None:
    """Publish the consistency table; log the summary and every finding."""
    logger = get_run_logger()
    create_table_artifact(key=ARTIFACT, table=report.table(), description=report.summary())
    logger.info("%s; report %s", report.summary(), path)
    for row in report.warnings:
        logger.warning("%s: %s; fix: %s", row.check, row.finding, row.remediation)
    for row in report.blocking:
        logger.error("%s: %s; fix: %s", row.check, row.finding, row.remediation)


@task(
    name="check_nodes",
    retries=2,
    retry_delay_seconds=[30, 120],
    retry_condition_fn=retry_on_transient,
    timeout_seconds=3 * 3600,
)
def check_nodes(inputs: NodesInputs) -> NodesResult:
    """Check the nodes; publish the consistency table; fail on blocking findings (retry only connection failures)."""
    return run(inputs, publish, _retries_left())


def _retries_left() -> int:
    """How many more attempts Prefect makes after this one if it fails with a TransientError."""
    ctx = TaskRunContext.get()
    if ctx is None:
        return 0
    return max(0, (ctx.task.retries or 0) - (ctx.task_run.run_count - 1))
