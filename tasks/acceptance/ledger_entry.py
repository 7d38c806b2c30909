"""An acceptance run's place in the ledger: its identity keys, its entry once accepted, and the figures of a
finished run workspace (what `tdeploy baseline --run` compares). The ledger (tasks/ledger) stores entries; this
module is what acceptance writes into it, so the ledger needs nothing of acceptance."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from tasks.acceptance.baselines import baseline_key, curve_identity
from tasks.acceptance.record import AcceptanceReport, UnreadableReport
from tasks.errors import UserError
from tasks.launch.cluster import ClusterConfig
from tasks.ledger.registry import (
    GoldenFigures,
    Ledger,
    LedgerEntry,
    NonFiniteFigures,
    Provenance,
    cluster_identity,
    cluster_key_of,
    code_version,
    dataset_key,
    golden_figures,
)
from tasks.run_id import new_run_id
from training.config import TrainConfig
from validation.goodput import Goodput
from validation.plan_accuracy import PlanAccuracy


def figures_of_workspace(root: Path) -> tuple[GoldenFigures, str | None]:
    """The figures of a finished acceptance run workspace (its report and distributed run), and its curve key
    (None when its report does not say)."""
    fix = "pass an acceptance run workspace (runs/<name>/acceptance/<run-id>) or a ledger entry id"
    try:
        report = AcceptanceReport.read(root)
    except UnreadableReport as err:
        raise UserError(err.message, fix) from err
    if "distributed" not in report.runs:
        raise UserError(f"{AcceptanceReport.path_in(root)}: the report names no distributed run", fix)
    output_dir = Path(report.runs["distributed"])
    regression = next((d for d in report.dimensions if d.name == "regression"), None)
    curve_key = regression.evidence.get("curve_key") if regression is not None else None
    try:
        figures = golden_figures(report.dimensions, output_dir)
    except NonFiniteFigures as err:
        raise UserError(str(err), "pass an acceptance run whose loss stayed finite (an accepted one)") from err
    if figures is None:
        raise UserError(f"{output_dir}: the distributed run wrote no result", "pass a finished acceptance run")
    return figures, curve_key if isinstance(curve_key, str) else None


def run_identity(cluster: ClusterConfig, run_train: TrainConfig, world_size: int) -> tuple[str, str, str]:
    """The curve key, cluster key and dataset key of an acceptance run's config (`run_train`)."""
    from training.workload import workload_of  # torch: `tdeploy baseline` reads figures, not datasets

    manifest = workload_of(run_train).manifest()
    return (
        baseline_key(curve_identity(run_train, world_size, manifest)),
        cluster_key_of(cluster),
        dataset_key(manifest),
    )


def record_entry(
    ledger: Ledger,
    cluster: ClusterConfig,
    train: TrainConfig,
    run_train: TrainConfig,
    world_size: int,
    figures: GoldenFigures,
    provenance: Provenance,
    workspace: Path,
    plan_accuracy: PlanAccuracy | None = None,
    goodput: Goodput | None = None,
) -> LedgerEntry:
    """Append the entry of an accepted run (with its goodput): keep its checkpoint (pinned), then write the entry
    itself."""
    entry_id = new_run_id()
    curve_key, cluster_key, data_key = run_identity(cluster, run_train, world_size)
    checkpoint = ledger.keep_checkpoint(entry_id, train, run_train)
    entry = LedgerEntry(
        entry_id=entry_id,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        spec_name=provenance.spec_name,
        spec_digest=provenance.spec_digest,
        cluster_key=cluster_key,
        cluster=cluster_identity(cluster),
        curve_key=curve_key,
        image_ref=provenance.image_ref,
        image_digest=provenance.image_digest,
        code_version=code_version(),
        dataset_key=data_key,
        train=train.model_dump(mode="json"),
        checkpoint=checkpoint,
        figures=figures,
        acceptance_run=str(workspace),
        plan_accuracy=plan_accuracy,
        goodput=goodput,
    )
    ledger.append(entry)
    return entry
