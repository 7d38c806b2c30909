"""The node-check step: plan, run the playbook, build the report, write it, and fail on blocking findings."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tasks.errors import TransientError, UserError
from tasks.launch.cluster import ClusterConfig
from tasks.nodes.config import NodesConfig
from tasks.nodes.drift import drift_rows
from tasks.nodes.inventory import CheckPlan, plan_checks
from tasks.nodes.report import NodeReport, Observed, Row
from tasks.nodes.runner import PlaybookRun, run_playbook
from tasks.nodes.status import (
    clock,
    gpu_health,
    interface,
    name_resolution,
    node_count,
    reachability,
    rendezvous,
    ssh_login,
    storage,
)

log = logging.getLogger(__name__)

# The rows of the hosts that reported their facts, in the order the report shows them.
SECTIONS: list[Callable[[Observed], list[Row]]] = [
    drift_rows,
    gpu_health,
    storage,
    name_resolution,
    interface,
    rendezvous,
    clock,
    ssh_login,
]


def build_report(run: PlaybookRun, plan: CheckPlan) -> NodeReport:
    """The consistency report of one playbook run."""
    seen = Observed.of(run, plan)
    rows = [reachability(seen), *node_count(seen)]
    if seen.reached:
        rows += [row for section in SECTIONS for row in section(seen)]
    for row in rows:
        row.values = {h: row.values[h] for h in run.hosts if h in row.values}
    return NodeReport(hosts=run.hosts, rows=rows, elapsed_s=run.elapsed_s, run_status=run.status, log=run.stdout)


def _failure_message(report: NodeReport) -> str:
    lines = [f"node checks failed on {', '.join(report.blocking_hosts) or 'the nodes'}: {report.summary()}"]
    lines += [f"  - {row.finding}; fix: {row.remediation}" for row in report.blocking]
    return "\n".join(lines)


class NodeCheckFailed(UserError):
    """Blocking findings that will not go away by themselves (drift, closed port, missing GPU, ...)."""

    def __init__(self, report: NodeReport, report_path: Path | None) -> None:
        where = f"see {report_path}" if report_path else "see the report"
        super().__init__(_failure_message(report), f"apply the fixes above ({where}) and check again")
        self.report, self.hosts = report, report.blocking_hosts


class NodesUnreachable(TransientError):
    """Only connection failures that may pass (timeout, connection reset): worth another try."""

    def __init__(self, report: NodeReport, report_path: Path | None, retries_left: int = 0) -> None:
        where = f"see {report_path}" if report_path else "see the report"
        if retries_left > 0:
            fix = f"retrying ({retries_left} more attempt(s)); if it persists, apply the fixes above ({where})"
        else:
            fix = f"no retry left: apply the fixes above ({where}) and check again"
        super().__init__(_failure_message(report), fix)
        self.report, self.hosts, self.retries_left = report, report.blocking_hosts, retries_left


def run_node_checks(nodes: NodesConfig, cluster: ClusterConfig) -> NodeReport:
    """Check the nodes of a deployment and return the consistency report (no exception for findings)."""
    plan = plan_checks(nodes, cluster)
    log.info("checking %s node(s) with %d fork(s)", len(plan.hosts) if plan.hosts else "inventory", plan.forks)
    run = run_playbook(
        plan.inventory,
        plan.extravars,
        forks=plan.forks,
        connect_timeout_s=plan.connect_timeout_s,
        task_timeout_s=plan.task_timeout_s,
        run_timeout_s=plan.run_timeout_s,
        host_order=plan.hosts,
    )
    return build_report(run, plan)


def raise_for_blocking(report: NodeReport, report_path: Path | None = None, retries_left: int = 0) -> None:
    """NodesUnreachable when every blocking finding may pass by itself; NodeCheckFailed for any other.

    `retries_left` is how many more attempts follow, so that the message says "retrying" only when one does.
    """
    if report.ok:
        return
    if all(row.transient for row in report.blocking):
        raise NodesUnreachable(report, report_path, retries_left)
    raise NodeCheckFailed(report, report_path)
