"""Prefect tasks `run_acceptance` and `run_drills`."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.acceptance.config import DRILLS, AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, reuse_acceptance
from tasks.acceptance.drills import run_drills as run_drill_list
from tasks.acceptance.record import AcceptanceReport
from tasks.acceptance.report import plot_losses, table_rows, write_junit
from tasks.acceptance.suite import run_acceptance as run_acceptance_suite
from tasks.acceptance.workspace import Workspace, mark_latest, open_workspace
from tasks.cluster import ClusterConfig
from tasks.deployment import AcceptanceResult
from tasks.errors import UserError, retry_on_transient
from tasks.ledger.registry import Provenance
from training.config import TrainConfig
from validation.plan_accuracy import PlannedFigures


class AcceptanceFailed(UserError):
    """A dimension or drill failed; the report says which and what to look at first."""


def publish(report: AcceptanceReport, root: Path, key: str, workspace: Workspace | None = None) -> AcceptanceResult:
    """Write the report, junit.xml and the loss plot into `root`; publish the table; point latest.json at
    `workspace` (once the reports exist); return the step's result."""
    paths = {
        "json": str(report.write(root)),
        "junit": str(write_junit(report, root / "junit.xml")),
        "plot": str(plot_losses(report, root / "loss_curve.png")) if report.runs else None,
    }
    create_table_artifact(key=key, table=table_rows(report), description=f"verdict: {report.to_json()['verdict']}")
    latest = str(mark_latest(workspace)) if workspace is not None else None
    data = report.to_json()
    return AcceptanceResult(verdict_text=data["verdict"], files=paths, report=data, root=str(root), latest=latest)


@task(name="run_acceptance", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def run_acceptance(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    root: str,
    image: str | None = None,
    soak: bool = False,
    drills: DrillConfig | None = None,
    with_drills: bool = False,
    faults: dict[str, str] | None = None,
    provenance: Provenance | None = None,
    planned: PlannedFigures | None = None,
) -> AcceptanceResult:
    """Run the acceptance suite (optionally with the drills) in the fresh run workspace `root`
    (see `workspace_root`), against the ledger's current baseline; fails when any dimension fails (the
    regression gate included). An accepted run is recorded in the ledger with `provenance`; with `planned` (the
    capacity plan's figures) its measured memory and step time are recorded beside them."""
    logger = get_run_logger()
    workspace = open_workspace(root, acceptance.keep_runs)
    logger.info("acceptance workspace %s", workspace.root)
    report = run_acceptance_suite(
        cluster, train, acceptance, workspace.root, faults, image, soak, drills, with_drills, provenance,
        planned=planned,
    )  # fmt: skip
    if report.plan_accuracy is not None:
        logger.info("%s", report.plan_accuracy.line())
    if report.ledger_entry:
        logger.info("recorded ledger entry %s: the current baseline now", report.ledger_entry)
    summary = publish(report, workspace.root, "acceptance", workspace)
    for row in table_rows(report):
        logger.info("%s: %s %s", row["check"], row["verdict"], row["look first"])
    if not report.passed:
        unmeasured = f" (not measured: {', '.join(report.not_measured)})" if report.not_measured else ""
        raise AcceptanceFailed(
            f"acceptance failed: {', '.join(report.failed)}{unmeasured}", f"see {summary.files['json']}"
        )
    return summary


@task(name="run_drills", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def run_drills(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    drills: DrillConfig,
    root: str,
    only: list[str] | None = None,
    image: str | None = None,
    faults: dict[str, str] | None = None,
) -> AcceptanceResult:
    """Run the checkpoint-restore drills under `root`/drills of a run workspace (the acceptance step's, or a
    new one); fails when a drill fails."""
    logger = get_run_logger()
    workspace = open_workspace(root, acceptance.keep_runs, "drills")
    logger.info("drills workspace %s", workspace.drills)
    fresh = DrillContext(cluster, train, workspace.drills, acceptance, drills, faults, image)
    reference, rank_kill = reuse_acceptance(workspace.root, fresh)
    ctx = DrillContext(cluster, train, workspace.drills, acceptance, drills, faults, image, reference=reference)
    chosen = only if only is not None else (drills.only if drills.only is not None else list(DRILLS))
    results = []
    if rank_kill is not None and "rank_kill" in chosen:
        logger.info("drill rank_kill: reused from the acceptance step in %s", workspace.root)
        results.append(rank_kill)
        chosen = [name for name in chosen if name != "rank_kill"]
    if reference is not None:
        logger.info("drills compare with the acceptance step's uninterrupted run %s", reference.output_dir)
    results += run_drill_list(
        ctx, chosen, on_result=lambda r: logger.info("drill %s: %s %s", r.name, r.passed, r.message)
    )
    report = AcceptanceReport(dimensions=[], drills=results)
    summary = publish(report, workspace.drills, "drills", workspace)
    if any(r.passed is False for r in results):
        failed = [r.name for r in results if r.passed is False]
        raise AcceptanceFailed(f"drills failed: {', '.join(failed)}", f"see {summary.files['json']}")
    return summary
