"""The acceptance suite: a distributed run and an independent single-process reference, judged by the check table
(tasks/acceptance/checks.py); and the drills, reusing what an acceptance run left in its workspace."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tasks.acceptance.baselines import judge_quality
from tasks.acceptance.checks import Judged, dimension_names, in_report_order, judge_runs, not_started, rows
from tasks.acceptance.compiled import compiled_on, with_compile_note
from tasks.acceptance.config import DRILLS, AcceptanceConfig, DrillConfig
from tasks.acceptance.drill_table import run_drills
from tasks.acceptance.drills import DrillContext, drill_rank_kill, reuse_acceptance, stopped_drill
from tasks.acceptance.fp8_parity import run_fp8_parity, with_fp8_parity
from tasks.acceptance.ledger_entry import record_entry, run_identity
from tasks.acceptance.mode import Mode
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.workspace import (
    Job,
    RunOutcome,
    Workspace,
    data_parallel_ranks,
    open_workspace,
    threads_per_rank,
    variant,
)
from tasks.launch.base import parse_root_cause
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.ledger.gate import check_regression
from tasks.ledger.registry import (
    GoldenFigures,
    Ledger,
    LedgerEntry,
    LedgerError,
    NonFiniteFigures,
    Provenance,
    golden_figures,
)
from tasks.paths import ledger_url, workspace_base
from tasks.progress import report
from tasks.run_id import new_run_id
from training.config import TrainConfig
from validation.acceptance import AcceptanceThresholds, DimensionResult, mesh_of, rank_metrics
from validation.data_consistency import Sampling, check_data_consistency, with_resumed_run
from validation.goodput import Goodput
from validation.plan_accuracy import PlanAccuracy, PlannedFigures, compare_plan, with_history
from validation.quality import with_quality

if TYPE_CHECKING:
    from tasks.acceptance.step import DrillsInputs

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
    environment: JobEnvironment | None = None,
    image: str | None = None,
) -> tuple[RunOutcome | None, RunOutcome]:
    """Run the correctness plan's jobs: the distributed side (None when the main run serves), the reference."""
    plan = correctness_plan(cluster, train, root, steps, acceptance.reference_steps)
    pair = None
    if plan.distributed is not None:
        phase = f"correctness run ({cluster.world_size} ranks, fp32, no dropout)"
        report("acceptance", phase, 0, acceptance.reference_steps)
        pair = Job(cluster, plan.distributed, "accept-correctness", environment, image, phase=phase).wait(
            acceptance.job_timeout_s, acceptance.thresholds.stall_timeout_s
        )
    phase = "independent reference (one process, fp32)"
    report("acceptance", phase, 0, acceptance.reference_steps)
    # No job environment: the reference runs none of the trainer's code, so no test fault reaches it.
    reference = Job(plan.reference_cluster, plan.reference, "accept-reference", None, image, phase=phase).wait(
        acceptance.job_timeout_s
    )
    return pair, reference


class AcceptanceInputs(BaseModel):
    """What an acceptance run (and the drills) needs: the deployment's cluster, its training config and acceptance
    section, the mode, and where its jobs run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cluster: ClusterConfig
    train: TrainConfig
    acceptance: AcceptanceConfig
    mode: Mode = Mode.FULL
    drills: DrillConfig | None = None
    """The drills' settings (the recovery dimension's rank_kill drill included); None: the defaults."""
    with_drills: bool = False
    """Also run the other drills (drills.only, else every one) after the suite (not in canary mode)."""
    image: str | None = None
    """The image reference the jobs run in (None: the nodes' own environment)."""
    environment: JobEnvironment | None = None
    """Variables the trainer's jobs get beside cluster.env (tasks/launch/environment.py): the tests', never a
    spec's."""
    provenance: Provenance | None = None
    """What the run was made from (spec, image), recorded in its ledger entry."""
    record: bool = True
    """An accepted run is recorded in the ledger (False: a new version's canary, before its full rollout)."""
    planned: PlannedFigures | None = None
    """The capacity plan's figures for the layout, to record the measured ones beside."""
    deployment_dir: str | None = None
    """The deployment's folder (tasks.paths), recorded in the quality baseline an accepted run writes (None: none
    recorded)."""


def run_acceptance(inputs: AcceptanceInputs, root: Path) -> AcceptanceReport:
    """Run the distributed job and the reference through the spec's scheduler in the run workspace `root` and
    judge them by the check table of `inputs.mode`, against the ledger's current baseline; an accepted run is
    recorded in the ledger (with `inputs.provenance`: spec and image).

    The jobs get cluster.env from the launcher. A canary (tdeploy rollout) is judged without the recovery drill:
    it asks whether a new version computes and performs like the baseline, not whether checkpoints restore (the
    full acceptance after it does). With `inputs.planned` the run's measured peak memory per rank and step time
    are recorded beside the plan's with the error (a planner finding when it persists over the ledger's runs).
    """
    cluster, train, acceptance, mode = inputs.cluster, inputs.train, inputs.acceptance, inputs.mode
    environment, image, drills = inputs.environment, inputs.image, inputs.drills
    soak = mode is Mode.SOAK and acceptance.soak_steps is not None
    provenance = inputs.provenance or Provenance()
    limits = acceptance.thresholds
    steps = acceptance.soak_steps if soak and acceptance.soak_steps is not None else acceptance.steps
    probe_mb = train.run.comm_probe_mb or ACCEPTANCE_COMM_PROBE_MB
    dist_train = variant(
        train,
        root,
        "distributed",
        run={"steps": steps, "comm_probe_mb": probe_mb},
        checkpoint={"save_every_steps": acceptance.save_every_steps},
    )
    phase = f"{'stability soak' if soak else 'distributed run'} ({cluster.world_size} ranks)"
    report("acceptance", phase, 0, steps)
    dist_job = Job(cluster, dist_train, "accept-distributed", environment, image, phase=phase)
    dist = dist_job.wait(acceptance.job_timeout_s, limits.stall_timeout_s)
    goodput = dist_job.goodput()
    start = check_start(dist)
    if start is not None:  # one finding; the reference, the correctness pair and the drills would tell nothing
        return AcceptanceReport(dimensions=not_started(start, mode), runs={"distributed": str(dist.output_dir)})
    pair, reference = run_correctness_pair(cluster, train, acceptance, root, steps, environment, image)
    judged_here = [c.name.replace("_", " ") for c in rows(mode) if c.judge is not None]
    report("acceptance", f"judging {', '.join(judged_here)}")
    dimensions = judge(cluster, dist_train, acceptance, dist, reference, pair, mode)
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
    compiled = compiled_on(train, pair or dist)  # the run correctness compared with the (eager) reference
    dimensions = [with_compile_note(d, compiled) if d.name == "correctness" else d for d in dimensions]
    if train.precision.dtype == "fp8" and "correctness" in dimension_names(mode) and dist.ok:
        parity = run_fp8_parity(cluster, dist_train, acceptance, root, dist, environment, image)
        dimensions = [with_fp8_parity(d, parity) if d.name == "correctness" else d for d in dimensions]
    ctx = DrillContext(
        cluster,
        train,
        root,
        acceptance,
        drills,
        environment,
        image,
        reference=dist if steps == acceptance.steps and dist.ok else None,
        progress_step="acceptance",
    )
    drill_results: list[DrillResult] = []
    recovery: DimensionResult | None = None
    if "recovery" not in dimension_names(mode):
        pass  # no recovery drill (a canary's): see the docstring
    elif dist.ok:
        report("acceptance", "recovery: rank_kill drill")
        try:
            kill, recovery = drill_rank_kill(ctx)
        except Exception as err:  # noqa: BLE001 - the drill's failure is its finding; the report is still written
            kill = stopped_drill("rank_kill", err)
            look = "the rank_kill drill's error above, then its jobs' logs under drill-rank-kill"
            recovery = DimensionResult(
                name="recovery", passed=False, evidence=kill.evidence, message=kill.message, look_first=look
            )
        drill_results.append(kill)
        if "output_dir" in kill.evidence:
            resumed = Sampling.of(ctx.train("drill-rank-kill"), cluster.world_size)
            resumed_data = check_data_consistency(Path(kill.evidence["output_dir"]), resumed)
            dimensions = [with_resumed_run(d, resumed_data) if d.name == "data_consistency" else d for d in dimensions]
    else:
        recovery = DimensionResult(
            name="recovery",
            passed=False,
            message="not drilled: the distributed run itself failed"
            + (f" ({dist.steps_lost.describe()})" if dist.steps_lost else ""),
            look_first="the stability dimension",
        )
    if recovery is not None:
        dimensions.append(recovery)
    try:
        figures, not_finite = golden_figures(dimensions, dist.output_dir), None
    except NonFiniteFigures as err:  # a diverged run: a regression finding, the report is still written
        figures, not_finite = None, err
    dimensions.append(regression_of(ledger, current, ledger_problem, figures, curve_key, acceptance, not_finite))
    if inputs.with_drills and dist.ok and mode is not Mode.CANARY:
        wanted = ctx.drills.only if ctx.drills.only is not None else list(DRILLS)
        drill_results += run_drills(ctx, [n for n in wanted if n != "rank_kill"])  # rank_kill ran above
    runs = {"distributed": str(dist.output_dir), "reference": str(reference.output_dir)}
    if pair is not None:  # the distributed side of correctness, when the main run could not serve
        runs["correctness"] = str(pair.output_dir)
    try:
        accuracy = None if inputs.planned is None else plan_accuracy(inputs.planned, ledger, dist, cluster, limits)
    except (OSError, ValueError) as err:  # the plan beside the run is a note, not a verdict: the report goes on
        log.warning("plan vs run: not compared: %s", err)
        accuracy = None
    accepted = AcceptanceReport(
        dimensions=in_report_order(dimensions), drills=drill_results, runs=runs, plan_accuracy=accuracy,
        goodput=goodput, distillation=dist.run.distillation() if dist.ok else None,
    )
    if accepted.passed and inputs.record:  # every dimension and drill: the run becomes the current baseline
        gate.record(root, dist.output_dir, inputs.deployment_dir)
        assert figures is not None  # a run without a result fails stability
        accepted.ledger_entry = _record(ledger, cluster, train, dist_train, world, figures, provenance, root, accuracy,
                                        goodput)  # fmt: skip
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
        return DimensionResult(
            name="regression", passed=False, measured={}, threshold={}, evidence={"ledger": ledger.url},
            message=str(problem), look_first=problem.fix or "",
        )  # fmt: skip
    if not_finite is not None and acceptance.regression.enabled:
        return DimensionResult(
            name="regression", passed=False, measured=dict(not_finite.figures), threshold={},
            evidence={"ledger": ledger.url, "curve_key": curve_key}, message=str(not_finite),
            look_first="the stability dimension: the first step whose loss was not finite",
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
    goodput: Goodput | None = None,
) -> str | None:
    """Append the accepted run's ledger entry; its id (None, with a warning, when the ledger cannot be written:
    the acceptance itself passed)."""
    try:
        entry = record_entry(ledger, cluster, train, dist_train, world, figures, provenance, root, accuracy, goodput)
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
    that never completed) has nothing for the other dimensions to judge: failing all of them would bury the cause.
    """
    if dist.ok or rank_metrics(dist.output_dir):
        return None
    error = job_error(dist)
    return DimensionResult(
        name="start",
        passed=False,
        measured={"state": dist.status.state.value, "steps_trained": 0},
        threshold={"steps_trained": ">= 1"},
        evidence={"job": dist.handle.ref, "log": dist.handle.log_path, "output": str(dist.output_dir)},
        message=f"the distributed job never started training: {error}",
        look_first="the error above: a spec, dataset or environment problem the job refused at start-up (fix it in "
        f"the spec or the data, not by rerunning); then the job's log {dist.handle.log_path}",
    )


def judge(
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    dist: RunOutcome,
    reference: RunOutcome,
    pair: RunOutcome | None = None,
    mode: Mode = Mode.FULL,
) -> list[DimensionResult]:
    """The check table's dimensions of `mode` judged from a finished distributed run's artifacts (connectivity,
    correctness, performance, stability and data consistency today). Correctness compares `pair` (the
    correctness plan's distributed run; None: `dist`) with the reference."""
    return judge_runs(Judged(cluster, train, acceptance, dist, reference, pair), mode)


def run_drill_suite(
    inputs: DrillsInputs,
    root: Path,
    only: list[str] | None = None,
    on_result: Callable[[DrillResult], None] | None = None,
) -> AcceptanceReport:
    """The drills (`only`, else drills.only, else every one) in `root`/drills of the run workspace `root`,
    reusing what an acceptance run left there (its uninterrupted run and a passed rank_kill drill,
    `reuse_acceptance`); their report. What `tdeploy drill` and the flows' drills step both run."""
    folder = Workspace.at(root).drills
    drills = inputs.drills or DrillConfig()
    args = (inputs.cluster, inputs.train, folder, inputs.acceptance, drills, inputs.environment, inputs.image)
    reference, rank_kill = reuse_acceptance(root, DrillContext(*args))
    ctx = DrillContext(*args, reference=reference)
    chosen = only if only is not None else (drills.only if drills.only is not None else list(DRILLS))
    results = []
    if rank_kill is not None and "rank_kill" in chosen:
        log.info("drill rank_kill: reused from the acceptance run in %s", root)
        results.append(rank_kill)
        if on_result:
            on_result(rank_kill)
        chosen = [name for name in chosen if name != "rank_kill"]
    if reference is not None:
        log.info("drills compare with the acceptance run's uninterrupted run %s", reference.output_dir)
    results += run_drills(ctx, chosen, on_result=on_result)
    return AcceptanceReport(dimensions=[], drills=results)
