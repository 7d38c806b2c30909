"""The `acceptance` and `drills` sections of the spec."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from tasks.ledger.config import RegressionConfig
from training.config import MAX_STEPS, StrictModel
from training.drill_points import SAVE_PHASES, SavePhase
from training.storage import LocalPath, StorageUrl
from validation.acceptance import AcceptanceThresholds

DrillName = Literal[
    "rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage", "node_loss", "preemption",
    "replica_loss", "spare_takeover", "memory_restore", "hang", "workload_error", "bad_node_recurrence",
]  # fmt: skip
DRILLS: tuple[DrillName, ...] = get_args(DrillName)
"""Every drill, in the order they run: the checkpoint-restore drills (restore from storage, rung 4 of the recovery
ladder), then one per rung of the ladder (live recovery, hot spare, memory restore), hang detection, and the
restart policy's two (a workload error is stopped, a node that fails twice is quarantined)."""


class CanaryConfig(StrictModel):
    """`tdeploy rollout`: the canary a new version runs on first (a short acceptance on a few nodes, held to the
    baseline by the regression gate) before it runs on the whole deployment."""

    nodes: int = Field(default=1, ge=1, le=100_000, description="Nodes of the canary (at most cluster.nodes).")
    steps: int | None = Field(
        default=None,
        ge=10,
        le=MAX_STEPS,
        description="Steps of the canary's acceptance run; None = acceptance.steps, which keeps the run's curve "
        "identity, so its loss curve is compared with the baseline's at the same seed (fewer steps: it is not).",
    )


class AcceptanceConfig(StrictModel):
    """How the deployment is accepted."""

    thresholds: AcceptanceThresholds = Field(default_factory=AcceptanceThresholds)
    steps: int = Field(
        default=200, ge=10, le=MAX_STEPS, description="Steps of the distributed acceptance run (and its drills)."
    )
    save_every_steps: int = Field(
        default=20, ge=1, le=MAX_STEPS, description="Checkpoint cadence of the acceptance runs."
    )
    reference_steps: int = Field(
        default=10,
        ge=2,
        le=MAX_STEPS,
        description="K: steps compared with the independent reference (training/reference.py). By "
        "benchmarks/acceptance_noise.py each injected fault exceeds the correctness tolerance by step 2.",
    )
    soak_steps: int | None = Field(
        default=None, ge=10, le=MAX_STEPS, description="Nightly: a longer stability run; None = steps."
    )
    work_url: LocalPath | None = Field(
        default=None,
        description="Local folder for the acceptance run workspaces (<work_url>/<run-id>/, latest.json); "
        "None = <deployment_dir>/acceptance (runs/<name>/acceptance).",
    )
    keep_runs: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Run workspaces kept under work_url (the current one and the latest finished one included); "
        "older ones are deleted when a new run starts.",
    )
    bit_identical_recovery: bool = Field(
        default=True, description="Recovery must reproduce the uninterrupted losses bit for bit (deterministic CPU)."
    )
    job_timeout_s: float = Field(
        default=3600.0, gt=0, le=30 * 86400, description="Longest any one acceptance job may take."
    )
    regression: RegressionConfig = Field(
        default_factory=RegressionConfig, description="The regression gate against the current ledger baseline."
    )
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="The canary of `tdeploy rollout`.")
    ledger_url: StorageUrl | None = Field(
        default=None,
        description="The deployment ledger (fsspec URL: a folder or s3://bucket/prefix; see tasks/ledger.py); "
        "None = <work_url>/ledger, beside the run workspaces and baselines/ (workspace pruning never touches it).",
    )


class DrillConfig(StrictModel):
    """Checkpoint-restore drills."""

    only: list[DrillName] | None = Field(default=None, description="Run just these drills ([] = none); None = all.")
    save_phases: list[SavePhase] = Field(
        default_factory=lambda: list(SAVE_PHASES),
        min_length=1,
        description="kill_during_save: the points of the save protocol to kill the job at, one job each "
        f"(of {', '.join(SAVE_PHASES)}).",
    )
    rto_max_s: float | None = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Largest recovery time (RTO: from the failure to the first step trained after it) a drill may "
        "take; None: not judged. It is wall time, which a busy machine stretches: set it with a margin over the "
        "figures benchmarks/recovery.py measures on the cluster.",
    )
    relaunch_steps: int = Field(
        default=3,
        ge=1,
        le=MAX_STEPS,
        description="Steps a drill's job trains past the point its check needs before it stops (compared with "
        "the uninterrupted run): kill_during_save's relaunches and corrupt_checkpoint's past their resume point, "
        "hang's restart past the hung step, preemption's resubmission past a save interval after its signal, "
        "storage_outage past the save after the outage.",
    )
