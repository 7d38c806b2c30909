"""The acceptance suite: a distributed run and an independent single-process reference, judged along six dimensions."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.acceptance.baselines import judge_quality
from tasks.acceptance.config import DRILLS, AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, drill_rank_kill, run_drills, stopped_drill
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.workspace import (
    Job,
    RunOutcome,
    data_parallel_ranks,
    new_run_id,
    open_workspace,
    threads_per_rank,
    variant,
    workspace_base,
)
from tasks.cluster import ClusterConfig
from tasks.launch.base import parse_root_cause
from tasks.ledger.gate import check_regression
from tasks.ledger.registry import (
    GoldenFigures,
    Ledger,
    LedgerEntry,
    LedgerError,
    NonFiniteFigures,
    Provenance,
    golden_figures,
    ledger_url,
    record_entry,
    run_identity,
)
from tasks.progress import report
from training.config import TrainConfig
from validation.acceptance import (
    DIMENSIONS,
    AcceptanceThresholds,
    DimensionResult,
    check_connectivity,
    check_correctness,
    check_performance,
    check_stability,
    mesh_of,
    rank_metrics,
    replica_problems,
)
from validation.data_consistency import Sampling, check_data_consistency, with_resumed_run
from validation.plan_accuracy import PlanAccuracy, PlannedFigures, compare_plan, with_history
from validation.quality import with_quality

log = logging.getLogger(__name__)

ACCEPTANCE_COMM_PROBE_MB = [1.0, 4.0]
"""The distributed run's start-up communication probe sizes (MiB) where the spec sets none: about 0.3 s with
4 gloo ranks on 2 CPU cores (1, 8 and 32 MiB take about 1.7 s)."""


def workspace_root(acceptance: AcceptanceConfig, train: TrainConfig, nightly: bool = False) -> str:
    """A new run workspace's root, <work_url>/<run-id> (nothing is created: `open_workspace` does that)."""
    return str(workspace_base(acceptance.work_url, train.run.output_url, nightly) / new_run_id())


def work_dir(acceptance: AcceptanceConfig, train: TrainConfig) -> Path:
    """A fresh, empty run workspace for `tdeploy accept` / `tdeploy drill` (older ones pruned); its root."""
    return open_workspace(workspace_root(acceptance, train), acceptance.keep_runs).root


@dataclass(frozen=True)
class CorrectnessPlan:
    """The jobs of the correctness comparison: the independent reference (training/reference.py) on one
    process, and the distributed side (None: the first steps of the main distributed run serve)."""

    reference_cluster: ClusterConfig
    reference: TrainConfig
    distributed: TrainConfig | None


def correctness_plan(
    cluster: ClusterConfig, train: TrainConfig, root: Path, steps: int, reference_steps: int
) -> CorrectnessPlan:
    """The reference_steps of a `steps`-step run (its LR schedule), both sides in fp32 without dropout.

    Dropout masks come from per-rank RNG streams and low precision from the kernels, neither of which one
    fp32 process reproduces; the main run keeps the spec's dropout and precision for the other dimensions, so
    the comparison needs a distributed run of its own unless the spec already trains in fp32 without dropout.
    """
    paired = {
        "model": {"dropout": 0.0},
        "precision": {"dtype": "fp32"},
        "run": {"steps": steps, "stop_after_steps": reference_steps},
        "checkpoint": {"save_every_steps": None, "save_at_end": False},
    }
    one = cluster.model_copy(update={"nodes": 1, "procs_per_node": 1, "max_restarts": 0})
    reference = variant(
        train,
        root,
        "reference",
        **{
            **paired,
            "run": {**paired["run"], "threads_per_rank": threads_per_rank(cluster, train)},
            "parallel": {"data_parallel": None},
            # its global batch: micro_batch x grad_accum_steps x the data-parallel degree (TP/PP peers share one)
            "reference": {"world_size": data_parallel_ranks(cluster, train)},
        },
    )
    as_spec = train.model.dropout == 0 and train.precision.dtype == "fp32"
    return CorrectnessPlan(one, reference, None if as_spec else variant(train, root, "correctness", **paired))


def run_correctness_pair(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    root: Path,
    steps: int,
    faults: dict[str, str] | None = None,
    image: str | None = None,
) -> tuple[RunOutcome | None, RunOutcome]:
    """Run the correctness plan's jobs: the distributed side (None when the main run serves), the reference."""
    plan = correctness_plan(cluster, train, root, steps, acceptance.reference_steps)
    pair = None
    if plan.distributed is not None:
        phase = f"correctness run ({cluster.world_size} ranks, fp32, no dropout)"
        report("acceptance", phase, 0, acceptance.reference_steps)
        pair = Job(cluster, plan.distributed, "accept-correctness", faults, image, phase=phase).wait(
            acceptance.job_timeout_s, acceptance.thresholds.stall_timeout_s
        )
    phase = "independent reference (one process, fp32)"
    report("acceptance", phase, 0, acceptance.reference_steps)
    # No faults: the reference runs none of the trainer's code, so no test fault reaches it.
    reference = Job(plan.reference_cluster, plan.reference, "accept-reference", None, image, phase=phase).wait(
        acceptance.job_timeout_s
    )
    return pair, reference


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
    provenance: Provenance | None = None,
    canary: bool = False,
    record: bool = True,
    planned: PlannedFigures | None = None,
) -> AcceptanceReport:
    """Run the distributed job and the reference through the spec's scheduler and judge them, against the
    ledger's current baseline; an accepted run is recorded in the ledger (with `provenance`: spec and image).

    The jobs get cluster.env from the launcher; `faults` are test-only fault variables (training/faults.py).
    A `canary` (tdeploy rollout) is judged without the recovery drill: it asks whether a new version computes
    and performs like the baseline, not whether checkpoints restore (the full acceptance after it does).
    `record` False: an accepted run is not recorded (a new version's canary, before its full rollout).
    `planned`: the capacity plan's figures for the layout; the run's measured peak memory per rank and step time
    are recorded beside them with the error (a planner finding when it persists over the ledger's runs).
    """
    provenance = provenance or Provenance()
    limits = acceptance.thresholds
    steps = acceptance.soak_steps if soak and acceptance.soak_steps else acceptance.steps
    probe_mb = train.run.comm_probe_mb or ACCEPTANCE_COMM_PROBE_MB
    dist_train = variant(
        train,
        root,
        "distributed",
        run={"steps": steps, "comm_probe_mb": probe_mb},
        checkpoint={"save_every_steps": acceptance.save_every_steps},
    )
    phase = f"{'stability soak' if soak and acceptance.soak_steps else 'distributed run'} ({cluster.world_size} ranks)"
    report("acceptance", phase, 0, steps)
    dist = Job(cluster, dist_train, "accept-distributed", faults, image, phase=phase).wait(
        acceptance.job_timeout_s, limits.stall_timeout_s
    )
    start = check_start(dist)
    if start is not None:  # one finding; the reference, the correctness pair and the drills would tell nothing
        why = "the distributed job never started training (see start)"
        unmeasured = [DimensionResult.not_measured(name, why, "the start finding") for name in DIMENSIONS]
        return AcceptanceReport(dimensions=[start, *unmeasured], runs={"distributed": str(dist.output_dir)})
    pair, reference = run_correctness_pair(cluster, train, acceptance, root, steps, faults, image)
    report("acceptance", "judging connectivity, correctness, performance, stability, data consistency")
    dimensions = judge(cluster, dist_train, acceptance, dist, reference, pair)
    world = data_parallel_ranks(cluster, train)
    ledger = Ledger(ledger_url(acceptance, train.run.output_url), train.storage)
    curve_key, cluster_key, _ = run_identity(cluster, dist_train, world)
    try:
        current, ledger_problem = ledger.current(provenance.spec_name, cluster_key, curve_key), None
    except LedgerError as err:
        current, ledger_problem = None, err
    golden = (
        (current.curve_key, current.entry_id, Path(current.acceptance_run).name, current.figures.curve())
        if current
        else None
    )
    gate = judge_quality(acceptance, train, dist_train, world, dist.output_dir, golden)
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
    recovery: DimensionResult | None = None
    if canary:
        pass  # no recovery drill: see the docstring
    elif dist.ok:
        report("acceptance", "recovery: rank_kill drill")
        try:
            kill, recovery = drill_rank_kill(ctx)
        except Exception as err:  # noqa: BLE001 - the drill's failure is its finding; the report is still written
            kill = stopped_drill("rank_kill", err)
            look = "the rank_kill drill's error above, then its jobs' logs under drill-rank-kill"
            recovery = DimensionResult("recovery", False, None, None, kill.evidence, kill.message, look)
        drill_results.append(kill)
        if "output_dir" in kill.evidence:
            resumed = Sampling.of(ctx.train("drill-rank-kill"), cluster.world_size)
            resumed_data = check_data_consistency(Path(kill.evidence["output_dir"]), resumed)
            dimensions = [with_resumed_run(d, resumed_data) if d.name == "data_consistency" else d for d in dimensions]
    else:
        recovery = DimensionResult(
            "recovery",
            False,
            None,
            None,
            {},
            "not drilled: the distributed run itself failed"
            + (f" ({dist.steps_lost.describe()})" if dist.steps_lost else ""),
            "the stability dimension",
        )
    if recovery is not None:
        dimensions.append(recovery)
    try:
        figures, not_finite = golden_figures(dimensions, dist.output_dir), None
    except NonFiniteFigures as err:  # a diverged run: a regression finding, the report is still written
        figures, not_finite = None, err
    dimensions.append(regression_of(ledger, current, ledger_problem, figures, curve_key, acceptance, not_finite))
    if with_drills and dist.ok and not canary:
        wanted = ctx.drills.only if ctx.drills.only is not None else list(DRILLS)
        drill_results += run_drills(ctx, [n for n in wanted if n != "rank_kill"])  # rank_kill ran above
    runs = {"distributed": str(dist.output_dir), "reference": str(reference.output_dir)}
    if pair is not None:  # the distributed side of correctness, when the main run could not serve
        runs["correctness"] = str(pair.output_dir)
    try:
        accuracy = None if planned is None else plan_accuracy(planned, ledger, dist, cluster, limits)
    except (OSError, ValueError) as err:  # the plan beside the run is a note, not a verdict: the report goes on
        log.warning("plan vs run: not compared: %s", err)
        accuracy = None
    accepted = AcceptanceReport(dimensions=dimensions, drills=drill_results, runs=runs, plan_accuracy=accuracy)
    if accepted.passed and record:  # every dimension and drill: the run becomes the current baseline
        gate.record(root, dist.output_dir)
        assert figures is not None  # a run without a result fails stability
        accepted.ledger_entry = _record(ledger, cluster, train, dist_train, world, figures, provenance, root, accuracy)
    return accepted


def plan_accuracy(
    planned: PlannedFigures, ledger: Ledger, dist: RunOutcome, cluster: ClusterConfig, limits: AcceptanceThresholds
) -> PlanAccuracy | None:
    """The distributed run's measured memory per rank and step time beside the plan's, a planner finding when
    the ledger's last accepted runs on the accelerator were off the same way (None: the run recorded no step)."""
    metrics = rank_metrics(dist.output_dir)
    if not any(metrics.values()):
        return None
    mesh = mesh_of(dist.output_dir, cluster.world_size)
    stage_of = {rank: coords["pp"] for rank, coords in mesh.coords.items()} if mesh else {}
    accuracy = compare_plan(planned, metrics, stage_of, limits.plan_max_rel_error, limits.warmup_steps_ignored)
    try:
        earlier = ledger.plan_accuracies(planned.accelerator)
    except LedgerError as err:  # the regression dimension reports the ledger's problem
        log.warning("plan vs run: the ledger's earlier runs could not be read: %s", err)
        earlier = []
    accuracy = with_history(accuracy, earlier, limits.plan_finding_runs)
    log.info("%s", accuracy.line())
    return accuracy


def regression_of(
    ledger: Ledger,
    current: LedgerEntry | None,
    problem: LedgerError | None,
    figures: GoldenFigures | None,
    curve_key: str,
    acceptance: AcceptanceConfig,
    not_finite: NonFiniteFigures | None = None,
) -> DimensionResult:
    """The regression dimension; a ledger that cannot be read fails it with the file and the fix, and so does a
    run whose loss figures are not finite (nothing to compare, nothing to record)."""
    if problem is not None:
        return DimensionResult("regression", False, {}, {}, {"ledger": ledger.url}, str(problem), problem.fix or "")
    if not_finite is not None and acceptance.regression.enabled:
        return DimensionResult(
            "regression", False, dict(not_finite.figures), {}, {"ledger": ledger.url, "curve_key": curve_key},
            str(not_finite), "the stability dimension: the first step whose loss was not finite",
        )  # fmt: skip
    return check_regression(ledger, current, figures, curve_key, acceptance.regression, acceptance.thresholds)


def _record(
    ledger: Ledger,
    cluster: ClusterConfig,
    train: TrainConfig,
    dist_train: TrainConfig,
    world: int,
    figures: GoldenFigures,
    provenance: Provenance,
    root: Path,
    accuracy: PlanAccuracy | None = None,
) -> str | None:
    """Append the accepted run's ledger entry; its id (None, with a warning, when the ledger cannot be written:
    the acceptance itself passed)."""
    try:
        entry = record_entry(ledger, cluster, train, dist_train, world, figures, provenance, root, accuracy)
    except OSError as err:
        log.warning("could not record the ledger entry in %s: %s", ledger.url, err)
        return None
    report("acceptance", f"recorded ledger entry {entry.entry_id}")
    return entry.entry_id


def job_error(outcome: RunOutcome) -> str:
    """The job's own error: its first failing rank's (torchrun's report), else the last error line of its log."""
    if outcome.status.failure is not None:
        return outcome.status.failure.describe()
    log_path = Path(outcome.handle.log_path)
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    cause = parse_root_cause(text)
    if cause is not None:
        return cause.describe()
    errors = [line.strip() for line in text.splitlines() if re.search(r"\w(Error|Exception)\b", line)]
    return errors[-1] if errors else outcome.status.describe()


def check_start(dist: RunOutcome) -> DimensionResult | None:
    """None once the distributed job trained a step; else the one finding that it never started, with its error.

    A job refused at start-up (a dataset made with another tokenizer, a spec the trainer rejects, a rendezvous
    that never completed) has nothing for the six dimensions to judge: failing all of them would bury the cause.
    """
    if dist.ok or rank_metrics(dist.output_dir):
        return None
    error = job_error(dist)
    return DimensionResult(
        "start",
        False,
        {"state": dist.status.state.value, "steps_trained": 0},
        {"steps_trained": ">= 1"},
        {"job": dist.handle.ref, "log": dist.handle.log_path, "output": str(dist.output_dir)},
        f"the distributed job never started training: {error}",
        "the error above: a spec, dataset or environment problem the job refused at start-up (fix it in the spec "
        f"or the data, not by rerunning); then the job's log {dist.handle.log_path}",
    )


def _hosts_of(outcome: RunOutcome) -> dict[int, str] | None:
    """Rank -> host name from the run's ranks.json (None before it was written)."""
    ranks = outcome.run.ranks()
    return None if ranks is None else {r["rank"]: r["host"] for r in ranks.ranks}


def judge(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    dist: RunOutcome,
    reference: RunOutcome,
    pair: RunOutcome | None = None,
) -> list[DimensionResult]:
    """Connectivity, correctness, performance, stability and data consistency of a finished distributed run.

    Correctness compares `pair` (the correctness plan's distributed run; None: `dist`) with the reference.
    """
    limits = acceptance.thresholds
    world = cluster.world_size
    dist_metrics = dist.metrics()
    dimensions = [
        check_connectivity(dist.output_dir, world, limits),
        correctness_of(pair or dist, dist, reference, acceptance, world),
        check_performance(
            rank_metrics(dist.output_dir),
            reference.metrics(),
            world,
            limits,
            sharding=train.parallel.sharding,
            mesh=mesh_of(dist.output_dir, world),
            hosts=_hosts_of(dist),
        ),
        check_stability(
            dist_metrics, limits, dist.ok, dist.status.describe(), dist.stalled_after_step, dist.unreachable_hosts
        ),  # fmt: skip
    ]
    dimensions.append(check_data_consistency(dist.output_dir, Sampling.of(train, world)))
    return dimensions
