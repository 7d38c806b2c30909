"""The acceptance checks as a table: one row per dimension a report can hold, in report order.

The suite judges the finished runs by the table's `runs` rows (`judge_runs`); the start, recovery and regression
rows are judged by the suite's own phases (the distributed job's state, the rank_kill drill, the ledger's
baseline) and placed by the table (`in_report_order`). Which dimensions a mode judges, the list a failed start
reports as not measured, and the docs site's dimension table (`markdown_table`) come from the same rows, so a new
dimension is one row here and its check function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.mode import Mode
from tasks.acceptance.workspace import RunOutcome
from tasks.launch.cluster import ClusterConfig
from training.config import TrainConfig
from validation.acceptance import (
    DimensionResult,
    check_connectivity,
    check_correctness,
    check_performance,
    check_stability,
    mesh_of,
    rank_metrics,
    replica_problems,
)
from validation.checkpoint_interval import recheck_run
from validation.data_consistency import Sampling, check_data_consistency

ALL_MODES = frozenset(Mode)
"""A row every mode judges."""


class Severity(StrEnum):
    """What a failing row does to the acceptance run."""

    STOPS = "stops the run"
    """The run fails and stops there: the dimensions judged from the run are reported as not measured."""
    FAILS = "fails the run"
    """The run fails; the other dimensions are still judged."""


class Stage(StrEnum):
    """How a row is judged."""

    START = "the distributed job's state, before anything else"
    RUNS = "the finished runs' artifacts (validation/)"
    DRILL = "the rank_kill drill: kill a rank, relaunch, compare"
    LEDGER = "the run's figures against the ledger's current baseline"


@dataclass(frozen=True)
class Judged:
    """What the `runs` rows judge: the distributed run (its config `train`), the one-process reference, and the
    correctness plan's distributed run (`pair`; None: the main run's first steps serve)."""

    cluster: ClusterConfig
    train: TrainConfig
    acceptance: AcceptanceConfig
    dist: RunOutcome
    reference: RunOutcome
    pair: RunOutcome | None = None


@dataclass(frozen=True, kw_only=True)
class Check:
    """One row: a dimension, what it judges, how a failure counts, how it is run, in which modes, its docs line."""

    name: str
    judges: str
    """What it judges, in a few words (the docs table's column)."""
    severity: Severity
    stage: Stage
    docs: str
    """Where its rules are described (a file, or a docs page)."""
    modes: frozenset[Mode] = ALL_MODES
    judge: Callable[[Judged], DimensionResult] | None = None
    """The function over the finished runs (`runs` rows); None where the suite's own phase judges it."""


def correctness_of(
    side: RunOutcome, dist: RunOutcome, reference: RunOutcome, acceptance: AcceptanceConfig, world: int
) -> DimensionResult:
    """Correctness of `side` (the correctness plan's distributed run; the main run `dist` where it serves) against
    the reference over acceptance.reference_steps: losses, gradient norms, the parameters after the last step;
    and the replica check (training/run_output.py params records) of `side` and of `dist`, by their meshes."""
    k = acceptance.reference_steps
    replicas = {}
    runs = {"distributed": dist} if side is dist else {"correctness": side, "distributed": dist}
    for label, run in runs.items():
        records = run.run.params()
        if records:  # a run that never reached its end records none: stability reports why
            mesh = mesh_of(run.output_dir, world)
            replicas[label] = replica_problems(records, mesh.coords if mesh is not None else None)
    return check_correctness(
        {s: m for s, m in side.metrics().items() if s <= k},
        reference.metrics(),
        acceptance.thresholds.correctness_max_rel_deviation,
        noise_factor=acceptance.thresholds.correctness_noise_factor,
        params=side.run.params(),
        reference_params=reference.run.params().get(0),
        replicas=replicas,
    )


def _hosts_of(outcome: RunOutcome) -> dict[int, str] | None:
    """Rank -> host name from the run's ranks.json (None before it was written)."""
    ranks = outcome.run.ranks()
    return None if ranks is None else {r["rank"]: r["host"] for r in ranks.ranks}


def _connectivity(j: Judged) -> DimensionResult:
    return check_connectivity(j.dist.output_dir, j.cluster.world_size, j.acceptance.thresholds)


def _correctness(j: Judged) -> DimensionResult:
    return correctness_of(j.pair or j.dist, j.dist, j.reference, j.acceptance, j.cluster.world_size)


def _performance(j: Judged) -> DimensionResult:
    world = j.cluster.world_size
    return check_performance(
        rank_metrics(j.dist.output_dir),
        j.reference.metrics(),
        world,
        j.acceptance.thresholds,
        sharding=j.train.parallel.sharding,
        mesh=mesh_of(j.dist.output_dir, world),
        hosts=_hosts_of(j.dist),
        interval=recheck_run(j.dist.output_dir, j.train.checkpoint.save_every_steps, _mtbf_s(j)),
    )


def _mtbf_s(j: Judged) -> float | None:
    """The job's MTBF the interval is re-checked under: checkpoint.mtbf_s, else cluster.mttf_hours / nodes."""
    if j.train.checkpoint.mtbf_s is not None or j.cluster.mttf_hours is None:
        return j.train.checkpoint.mtbf_s
    return j.cluster.mttf_hours * 3600 / j.cluster.nodes


def _stability(j: Judged) -> DimensionResult:
    d = j.dist
    return check_stability(
        d.metrics(), j.acceptance.thresholds, d.ok, d.status.describe(), d.stalled_after_step, d.unreachable_hosts
    )


def _data_consistency(j: Judged) -> DimensionResult:
    return check_data_consistency(j.dist.output_dir, Sampling.of(j.train, j.cluster.world_size))


CHECKS: tuple[Check, ...] = (
    Check(name="start", judges="the distributed job trained a step (else its own error, once)",
          severity=Severity.STOPS, stage=Stage.START, docs="tasks/acceptance/suite.py check_start"),
    Check(name="connectivity", judges="world size, ranks, mesh places and sub-groups, collectives, bandwidth",
          severity=Severity.FAILS, stage=Stage.RUNS, docs="validation/acceptance.py check_connectivity",
          judge=_connectivity),
    Check(name="correctness", judges="losses, gradient norms, parameters and replicas against the reference; "
          "the quality gate", severity=Severity.FAILS, stage=Stage.RUNS,
          docs="validation/acceptance.py check_correctness, validation/quality.py", judge=_correctness),
    Check(name="performance", judges="scaling efficiency, communication share, stragglers, resource gates "
          "(compute share, GPU use, memory), gradient sync",
          severity=Severity.FAILS, stage=Stage.RUNS, docs="validation/acceptance.py check_performance",
          judge=_performance),
    Check(name="stability", judges="abnormal exit, NaN/Inf loss, loss spikes, stalls",
          severity=Severity.FAILS, stage=Stage.RUNS, docs="validation/acceptance.py check_stability",
          judge=_stability),
    Check(name="data_consistency", judges="every sample once per epoch, across resumes",
          severity=Severity.FAILS, stage=Stage.RUNS, docs="validation/data_consistency.py", judge=_data_consistency),
    Check(name="recovery", judges="a killed rank's job resumes from the last checkpoint, bit for bit",
          severity=Severity.FAILS, stage=Stage.DRILL, docs="tasks/acceptance/drills.py drill_rank_kill",
          modes=frozenset({Mode.FULL, Mode.SOAK})),
    Check(name="regression", judges="loss curve, throughput, step, save and bus-bandwidth figures vs the baseline",
          severity=Severity.FAILS, stage=Stage.LEDGER, docs="tasks/ledger/gate.py check_regression"),
)  # fmt: skip
"""Every dimension a report can hold, in report order."""


def rows(mode: Mode = Mode.FULL) -> list[Check]:
    """The rows `mode` judges, in report order."""
    return [c for c in CHECKS if mode in c.modes]


def dimension_names(mode: Mode = Mode.FULL) -> list[str]:
    """The dimensions a report of `mode` holds, in report order (start only when it failed)."""
    return [c.name for c in rows(mode)]


def run_dimensions(mode: Mode = Mode.FULL) -> list[str]:
    """The dimensions of `mode` judged from the distributed run (its artifacts and the rank_kill drill), in
    report order: what a run that never started leaves not measured."""
    return [c.name for c in rows(mode) if c.stage in (Stage.RUNS, Stage.DRILL)]


def judge_runs(judged: Judged, mode: Mode = Mode.FULL) -> list[DimensionResult]:
    """Every `runs` row of `mode` over the finished runs, in report order."""
    return [c.judge(judged) for c in rows(mode) if c.judge is not None]


def not_started(start: DimensionResult, mode: Mode = Mode.FULL) -> list[DimensionResult]:
    """A report's dimensions when the distributed job never trained a step: the start finding, and the dimensions
    judged from the run not measured (their finding is the start's; with no figures there is no regression row)."""
    why = "the distributed job never started training (see start)"
    return [start, *(DimensionResult.not_measured(name, why, "the start finding") for name in run_dimensions(mode))]


def in_report_order(dimensions: list[DimensionResult]) -> list[DimensionResult]:
    """`dimensions` in the table's order (a name the table lacks keeps its place after the table's)."""
    order = {c.name: i for i, c in enumerate(CHECKS)}
    return sorted(dimensions, key=lambda d: order.get(d.name, len(order)))


def markdown_table() -> str:
    """The dimension table of the docs page concepts/acceptance.md."""
    lines = ["| dimension | judges | a failure | judged from | modes | rules |", "|---|---|---|---|---|---|"]
    for c in CHECKS:
        modes = "all" if c.modes == ALL_MODES else ", ".join(m.value for m in Mode if m in c.modes)
        lines.append(f"| {c.name} | {c.judges} | {c.severity.value} | {c.stage.value} | {modes} | `{c.docs}` |")
    return "\n".join(lines)
