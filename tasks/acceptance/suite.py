"""The acceptance suite: a distributed run and a single-process reference, judged along six dimensions."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.acceptance.baselines import judge_quality
from tasks.acceptance.config import DRILLS, AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, DrillResult, drill_rank_kill, run_drills
from tasks.acceptance.workspace import (
    Job,
    RunOutcome,
    new_run_id,
    open_workspace,
    single_process,
    variant,
    workspace_base,
)
from tasks.cluster import ClusterConfig
from tasks.progress import report
from training.config import TrainConfig
from training.dataset import TokenDataset
from validation.acceptance import (
    DimensionResult,
    check_connectivity,
    check_correctness,
    check_data_consistency,
    check_performance,
    check_stability,
    rank_metrics,
)
from validation.quality import with_quality

log = logging.getLogger(__name__)


@dataclass
class AcceptanceReport:
    """Every dimension and drill, and the overall verdict."""

    dimensions: list[DimensionResult]
    drills: list[DrillResult] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """All dimensions passed and no drill failed (a drill that does not apply is not a failure)."""
        return all(d.passed for d in self.dimensions) and all(d.passed is not False for d in self.drills)

    def to_json(self) -> dict[str, Any]:
        """acceptance.json."""
        return {
            "verdict": "passed" if self.passed else "failed",
            "dimensions": [d.to_json() for d in self.dimensions],
            "drills": [d.to_json() for d in self.drills],
            "runs": self.runs,
        }


def workspace_root(acceptance: AcceptanceConfig, train: TrainConfig, nightly: bool = False) -> str:
    """A new run workspace's root, <work_url>/<run-id> (nothing is created: `open_workspace` does that)."""
    return str(workspace_base(acceptance.work_url, train.run.output_url, nightly) / new_run_id())


def work_dir(acceptance: AcceptanceConfig, train: TrainConfig) -> Path:
    """A fresh, empty run workspace for `tdeploy accept` / `tdeploy drill` (older ones pruned); its root."""
    return open_workspace(workspace_root(acceptance, train), acceptance.keep_runs).root


def run_acceptance(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    root: Path,
    faults: dict[str, str] | None = None,
    image: str | None = None,
    soak: bool = False,
    drills: DrillConfig | None = None,
    with_drills: bool = False,
) -> AcceptanceReport:
    """Run the distributed job and the reference through the spec's scheduler and judge them.

    The jobs get cluster.env from the launcher; `faults` are test-only fault variables (training/faults.py).
    """
    limits = acceptance.thresholds
    steps = acceptance.soak_steps if soak and acceptance.soak_steps else acceptance.steps
    dist_train = variant(
        train, root, "distributed", run={"steps": steps}, checkpoint={"save_every_steps": acceptance.save_every_steps}
    )
    phase = f"{'stability soak' if soak and acceptance.soak_steps else 'distributed run'} ({cluster.world_size} ranks)"
    report("acceptance", phase, 0, steps)
    dist = Job(cluster, dist_train, "accept-distributed", faults, image, phase=phase).wait(
        acceptance.job_timeout_s, limits.stall_timeout_s
    )
    one, sections = single_process(cluster, train)
    sections = {
        **sections,
        "run": {**sections["run"], "steps": steps, "stop_after_steps": acceptance.reference_steps},
        "checkpoint": {"save_every_steps": None, "save_at_end": False},
    }
    ref_train = variant(train, root, "reference", **sections)
    phase = "single-process reference"
    report("acceptance", phase, 0, acceptance.reference_steps)
    reference = Job(one, ref_train, "accept-reference", faults, image, phase=phase).wait(acceptance.job_timeout_s)
    report("acceptance", "judging connectivity, correctness, performance, stability, data consistency")
    dimensions = judge(cluster, dist_train, acceptance, dist, reference)
    gate = judge_quality(acceptance, train, dist_train, cluster.world_size, dist.output_dir)
    dimensions = [with_quality(d, gate.result) if d.name == "correctness" else d for d in dimensions]
    ctx = DrillContext(
        cluster,
        train,
        root,
        acceptance,
        drills,
        faults,
        image,
        reference=dist if steps == acceptance.steps and dist.ok else None,
        progress_step="acceptance",
    )
    drill_results: list[DrillResult] = []
    if dist.ok:
        report("acceptance", "recovery: rank_kill drill")
        kill, recovery = drill_rank_kill(ctx)
        drill_results.append(kill)
    else:
        recovery = DimensionResult(
            "recovery",
            False,
            None,
            None,
            {},
            "not drilled: the distributed run itself failed",
            "the stability dimension",
        )
    dimensions.append(recovery)
    if with_drills and dist.ok:
        wanted = ctx.drills.only if ctx.drills.only is not None else list(DRILLS)
        drill_results += run_drills(ctx, [n for n in wanted if n != "rank_kill"])  # rank_kill ran above
    accepted = AcceptanceReport(
        dimensions, drill_results, {"distributed": str(dist.output_dir), "reference": str(reference.output_dir)}
    )
    if accepted.passed:  # every dimension and drill: the first accepted run of its key becomes the baseline
        gate.record(root, dist.output_dir)
    return accepted


def judge(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    dist: RunOutcome,
    reference: RunOutcome,
) -> list[DimensionResult]:
    """Connectivity, correctness, performance, stability and data consistency of a finished distributed run."""
    limits = acceptance.thresholds
    world = cluster.world_size
    k = acceptance.reference_steps
    dist_metrics = dist.metrics()
    dimensions = [
        check_connectivity(dist.output_dir, world),
        check_correctness(
            {s: m for s, m in dist_metrics.items() if s <= k}, reference.metrics(), limits.correctness_max_rel_deviation
        ),
        check_performance(rank_metrics(dist.output_dir), reference.metrics(), world, limits),
        check_stability(dist_metrics, limits, dist.ok, dist.status.describe(), dist.stalled_after_step),
    ]
    n_samples = len(TokenDataset(train.data.dataset_url, train.data.train_split, train.model.seq_len, train.storage))
    dimensions.append(
        check_data_consistency(
            dist.output_dir,
            n_samples,
            train.parallel.micro_batch,
            train.parallel.grad_accum_steps,
            world,
            train.run.seed,
        )
    )
    return dimensions
