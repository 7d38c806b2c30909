"""Prefect task `check_nodes`: thin wrapper over `run_node_checks`, retried only when nodes were unreachable."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.context import TaskRunContext

from tasks.cluster import ClusterConfig
from tasks.deployment import NodesResult
from tasks.errors import retry_on_transient
from tasks.nodes.check import raise_for_blocking, run_node_checks, write_report
from tasks.nodes.config import NodesConfig


@task(
    name="check_nodes",
    retries=2,
    retry_delay_seconds=[30, 120],
    retry_condition_fn=retry_on_transient,
    timeout_seconds=3 * 3600,
)
def check_nodes(
    nodes: NodesConfig, cluster: ClusterConfig, report_path: str, artifact_key: str = "node-checks"
) -> NodesResult:
    """Check the nodes; publish the consistency table; fail on blocking findings (retry only connection failures)."""
    logger = get_run_logger()
    report = run_node_checks(nodes, cluster)
    path = write_report(report, report_path)
    create_table_artifact(key=artifact_key, table=report.table(), description=report.summary())
    logger.info("%s; report %s", report.summary(), path)
    for row in report.warnings:
        logger.warning("%s: %s; fix: %s", row.check, row.finding, row.remediation)
    for row in report.blocking:
        logger.error("%s: %s; fix: %s", row.check, row.finding, row.remediation)
    raise_for_blocking(report, Path(path), _retries_left())
    return NodesResult.of(report, str(path))


def _retries_left() -> int:
    """How many more attempts Prefect makes after this one if it fails with a TransientError."""
    ctx = TaskRunContext.get()
    if ctx is None:
        return 0
    return max(0, (ctx.task.retries or 0) - (ctx.task_run.run_count - 1))
