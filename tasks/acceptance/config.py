"""The `acceptance` and `drills` sections of the spec."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from training.config import MAX_STEPS, StrictModel
from training.faults import SAVE_PHASES, SavePhase
from training.storage import LocalPath, StorageUrl
from validation.acceptance import AcceptanceThresholds

DrillName = Literal[
    "rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage", "node_loss", "preemption"
]
DRILLS: tuple[DrillName, ...] = (
    "rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage", "node_loss", "preemption",
)  # fmt: skip


class RegressionConfig(StrictModel):
    """The regression gate: an acceptance run against the current baseline (the newest accepted, not rolled back,
    ledger entry of the same spec and cluster). A limit of None leaves that figure unjudged (still shown)."""

    enabled: bool = Field(default=True, description="Compare with the current baseline at all.")
    tokens_per_s_drop_max: float | None = Field(
        default=0.10,
        ge=0,
        le=1,
        description="Largest relative drop of tokens/s below the baseline's (0.10 = 10%); on CPU runs of tokens per "
        "CPU-second, which a busy host does not lower (wall-time tokens/s is then shown, not judged).",
    )
    step_time_rise_max: float | None = Field(
        default=0.15,
        ge=0,
        le=100,
        description="Largest relative rise of the median step time over the baseline's (on CPU runs: of the step's "
        "CPU time).",
    )
    comm_share_rise_max: float | None = Field(
        default=None, ge=0, le=1, description="Largest rise of the communication share (absolute, 0.1 = 10 points)."
    )
    checkpoint_save_rise_max: float | None = Field(
        default=1.0, ge=0, le=100, description="Largest relative rise of the median checkpoint save time."
    )
    busbw_drop_max: float | None = Field(
        default=0.2, ge=0, le=1, description="Largest relative drop of the all-reduce bus bandwidth (when measured)."
    )
    loss_max_rel_worse: float | None = Field(
        default=None,
        ge=0,
        le=10,
        description="Loss curve at the same seed (the quality gate's comparison: final validation loss and the "
        "tail's mean training loss); None = thresholds.quality_max_rel_worse.",
    )
    noise_floor_s: float = Field(
        default=0.2,
        ge=0,
        le=3600,
        description="tokens/s and step time of a baseline whose median step took less than this, and the bus "
        "bandwidth of a baseline whose timed probe all-reduces took less than this in all (raise run.comm_probe_mb "
        "to judge it), are shown but not judged: a few milliseconds of scheduler noise on a shared host are a large "
        "share of such intervals.",
    )
    throughput_min_interval_s: float = Field(
        default=1.0,
        ge=0,
        le=86400,
        description="tokens/s and step time (wall or CPU) are judged only when the steady-state steps they are "
        "measured over took at least this long in all, in the baseline and in the run (timed_s, cpu_timed_s; as "
        "the bus bandwidth is by its timed all-reduces); a shorter interval is shown but not judged.",
    )
    noise_multiple: float = Field(
        default=2.0,
        ge=0,
        le=100,
        description="The limit of a timing figure widens to this many times the baseline's own spread: the "
        "figure's range over the baseline's last noise_runs runs (ledger entries of the same spec, cluster and "
        "curve identity), relative to their median (absolute for the communication share).",
    )
    noise_runs: int = Field(
        default=5, ge=2, le=1000, description="The baseline's runs its spread is taken over (2 or more are needed)."
    )
    save_noise_floor_s: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="The checkpoint save time of a baseline whose median save took less than this is shown but "
        "not judged (a small save is dominated by fsync and the page cache).",
    )


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
    relaunch_steps: int = Field(
        default=3,
        ge=1,
        le=MAX_STEPS,
        description="kill_during_save: steps each relaunch trains past its resume point (compared with the "
        "uninterrupted run).",
    )
