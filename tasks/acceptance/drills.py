"""Checkpoint-restore drills: kill a rank, kill during a save, corrupt a checkpoint, reshard, cut the storage.

Each drill runs real jobs through the spec's launcher and reports the recovery
time (failure to first resumed step), the steps lost, and whether the state
matched an uninterrupted run of the same job.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.outage import TcpProxy
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.workspace import (
    Job,
    RunOutcome,
    data_parallel_layout,
    first_step_time_after,
    last_step,
    single_process,
    variant,
)
from tasks.errors import UserError
from tasks.hosts import NodeHost
from tasks.launch import registry
from tasks.launch.base import JobState, JobStatus, find_job
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from training.checkpoint import COMMIT, CheckpointFormatError, CheckpointManager, copy_step, step_dir_name
from training.config import TrainConfig
from training.drill_points import HOLD_MARKER_PREFIX, RELEASE_FILE, SAVE_PHASES, SavePhase, paused_ranks
from training.layout import Layout
from training.preemption import records_since as preemption_records
from training.run_output import CheckpointEvent, RunOutput
from validation.acceptance import DimensionResult, RecoveryFigures, check_recovery
from validation.data_consistency import Sampling, check_data_consistency

log = logging.getLogger(__name__)


class BrokenCommit(UserError):
    """A drill job's own save committed a record that is not what the trainer's commit protocol writes."""


def committed_steps(train: TrainConfig) -> list[int]:
    """Steps with a committed checkpoint; BrokenCommit (the drill's finding) for a malformed COMMIT.json, which
    in a drill's folder only the drill's own jobs wrote."""
    manager = CheckpointManager(train.checkpoint, train.storage)
    steps = []
    for step in manager.steps_on_storage():
        try:
            commit = manager.read_commit(step)
        except CheckpointFormatError as err:
            raise BrokenCommit(
                f"{err.path} {err.problem}: written by this drill's own job, whose save committed a broken record",
                "the job's checkpoint events (checkpoints.jsonl) and log say which save; fix the trainer's save",
            ) from err
        if commit is not None:
            steps.append(step)
    return steps


def stopped_drill(name: str, err: Exception) -> DrillResult:
    """The finding of drill `name` that an error stopped: failed, with the error (and its fix, when it has one)."""
    fix = getattr(err, "fix", None)
    log.error("drill %s stopped: %s: %s", name, type(err).__name__, err, exc_info=err)
    return DrillResult(
        name, False, message=f"the drill stopped: {type(err).__name__}: {err}" + (f"; fix: {fix}" if fix else ""),
        evidence={"error": type(err).__name__},
    )  # fmt: skip


def _skipped_for(outcome: RunOutcome, step: int, reason: str) -> bool:
    """The job's resume record says it passed over checkpoint `step` for `reason`."""
    record = outcome.run.resume()
    skipped = record.skipped_step(step) if record is not None else None
    return skipped is not None and skipped.reason == reason


class DrillContext:
    """Shared settings and the uninterrupted reference run the drills compare against."""

    def __init__(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        root: Path,
        acceptance: AcceptanceConfig,
        drills: DrillConfig | None = None,
        environment: JobEnvironment | None = None,
        image: str | None = None,
        reference: RunOutcome | None = None,
        progress_step: str = "drills",
    ) -> None:
        self.cluster, self.root, self.acceptance = cluster, root, acceptance
        self.progress_step = progress_step
        self.drills = drills or DrillConfig()
        self.environment, self.image = environment or JobEnvironment(), image
        # These drills restore from storage (rung 4): no in-memory copies; the ladder's drills turn them on.
        self.base = variant(
            train, root, "drill-base", run={"steps": acceptance.steps},
            checkpoint={"save_every_steps": acceptance.save_every_steps, "memory_every_steps": None},
        )  # fmt: skip
        self._reference = reference

    def train(self, name: str, **sections: dict[str, Any]) -> TrainConfig:
        """The drill job `name`'s config."""
        return variant(self.base, self.root, name, **sections)

    def stop_after(self, step: int) -> dict[str, int]:
        """The `run` section of a drill job that stops drills.relaunch_steps past `step`, the last step its drill
        needs before the recovery is compared (a resume point, a save after an outage), schedule unchanged: a
        drill's check compares the steps after its recovery with the uninterrupted run's, and every later step
        would only repeat the acceptance run (capped at acceptance.steps)."""
        return {"stop_after_steps": min(self.base.run.steps, step + self.drills.relaunch_steps)}

    def reference(self) -> RunOutcome:
        """The same job, never interrupted (run on first use)."""
        if self._reference is None:
            job = self.job(self.train("drill-reference"), "drill-reference")
            self._reference = job.wait(self.acceptance.job_timeout_s)
            if not self._reference.ok:
                raise UserError(f"the drills' reference run failed: {self._reference.status.describe()}", "see its log")
        return self._reference

    def job(
        self,
        train: TrainConfig,
        name: str,
        cluster: ClusterConfig | None = None,
        environment: JobEnvironment | None = None,
    ) -> Job:
        """Submit a drill job (its training steps reported as progress of `progress_step`); `environment` replaces
        the context's job environment for this job alone."""
        chosen = self.environment if environment is None else environment
        return Job(cluster or self.cluster, train, name, chosen, self.image, self.progress_step, name)

    def recovery(
        self, resumed: RunOutcome, checkpoint_step: int | None, bit_identical: bool | None = None
    ) -> DimensionResult:
        """The resumed run against the reference: resume point, data steps and losses."""
        ref = self.reference()
        resumed_from = resumed.ranks().ranks[0]["resumed_from_step"]
        exact = self.acceptance.bit_identical_recovery if bit_identical is None else bit_identical
        return check_recovery(
            ref.metrics(), resumed.metrics(), checkpoint_step, resumed_from,
            resumed.run.all_samples() if exact else None, ref.run.all_samples() if exact else None, exact,
        )  # fmt: skip


def _finish(name: str, recovery: DimensionResult, t_fail: float, outcome: RunOutcome, steps_lost: int | None,
            extra: dict[str, Any] | None = None) -> DrillResult:  # fmt: skip
    resumed_from = recovery.figures_as(RecoveryFigures).resumed_from_step
    t_first = (
        first_step_time_after(outcome.output_dir, (resumed_from or 0) + 1, t_fail) if resumed_from is not None else None
    )
    return DrillResult(
        name=name,
        passed=recovery.passed and outcome.ok,
        recovery_s=None if t_first is None else t_first - t_fail,
        steps_lost=steps_lost,
        state_matched=recovery.passed,
        message=recovery.message or ("" if outcome.ok else f"the resumed job {outcome.status.describe()}"),
        evidence={"output_dir": str(outcome.output_dir), "resumed_from_step": resumed_from, **(extra or {})},
    )


def reuse_acceptance(root: Path, ctx: DrillContext) -> tuple[RunOutcome | None, DrillResult | None]:
    """The uninterrupted distributed run and the rank_kill drill that the acceptance step left in the run
    workspace `root`, when they are what the drills would run themselves (the same job but for its folders,
    finished; the drill passed): the drills step then reuses them instead of running both again."""
    try:
        report = AcceptanceReport.read(root)
        out = Path(report.runs["distributed"])
        accepted = TrainConfig.from_json_file(out / "run.json")
        handle = find_job(str(out))
    except (OSError, ValueError, KeyError, TypeError, UserError):  # UnreadableReport is a UserError
        return None, None  # no acceptance step ran here (or it left nothing usable): run them afresh
    kill = next((d for d in report.drills if d.name == "rank_kill"), None)

    def without_folders(cfg: TrainConfig) -> dict[str, Any]:
        """The job but for its folders, the communication probe the acceptance run adds (collectives at
        start-up, before the first step, that touch neither the weights nor the random streams) and the in-memory
        copies (taken between steps, they change no loss)."""
        dump = cfg.model_dump()
        dump["run"]["output_url"] = dump["checkpoint"]["url"] = dump["run"]["comm_probe_mb"] = None
        dump["checkpoint"]["memory_every_steps"] = dump["checkpoint"]["memory_dir"] = None
        return dump

    result = RunOutput(out).result()
    if without_folders(accepted) != without_folders(ctx.base) or result is None or result.steps != ctx.base.run.steps:
        return None, None
    finished = JobStatus(JobState.SUCCEEDED, "finished in the acceptance step")
    reference = RunOutcome(handle, finished, out, checkpoint_url=accepted.checkpoint.url)
    reused = None
    if kill is not None and kill.passed is True:
        reused = kill
        reused.evidence = {**reused.evidence, "reused_from": str(AcceptanceReport.path_in(root))}
    return reference, reused


def kill_victim(ranks: list[dict[str, Any]]) -> tuple[int, dict[str, int] | None]:
    """The rank the rank_kill drill kills, and its mesh coordinates: rank 1 (not rank 0, which writes the job's
    records, where there is another); on a model-parallel layout the first rank inside a tensor-parallel group
    (tp coordinate 1), else inside a pipeline (a later stage), so the survivors of its group hang in a collective
    that only the restart ends."""
    by_rank = {r["rank"]: r.get("mesh") for r in ranks}
    meshed = {rank: mesh["coords"] for rank, mesh in by_rank.items() if mesh}
    for dim in ("tp", "pp", "ep"):
        inside = sorted(rank for rank, c in meshed.items() if rank > 0 and c.get(dim, 0) > 0)
        if inside:
            return inside[0], meshed[inside[0]]
    victim = min(1, max(by_rank, default=0))
    return victim, meshed.get(victim)


def _past_first_checkpoint(
    ctx: DrillContext, name: str, cluster: ClusterConfig | None = None, stop_after: int | None = None
) -> tuple[TrainConfig, Job, Callable[[], None]]:
    """Start drill job `name` (on `cluster`, default the context's; stopping drills.relaunch_steps past step
    `stop_after`, None: at acceptance.steps) and wait until every rank holds one step past its first committed
    checkpoint (training.drill_points.StepHold); returns the job and what releases it, to be called once the drill
    has struck."""
    train = ctx.train(name) if stop_after is None else ctx.train(name, run=ctx.stop_after(stop_after))
    first_save = ctx.acceptance.save_every_steps
    markers = ctx.root / name / "hold"
    hold = {"step": first_save + 1, "marker_dir": str(markers), "timeout_s": ctx.acceptance.job_timeout_s}
    job = ctx.job(train, name, cluster=cluster, environment=ctx.environment.with_drill_points(hold_after_step=hold))
    job.wait_until(
        lambda: len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == ctx.cluster.world_size,
        f"every rank past the first checkpoint (step {first_save})", ctx.acceptance.job_timeout_s,
    )  # fmt: skip

    def release() -> None:
        (markers / RELEASE_FILE).touch()

    return train, job, release


def drill_rank_kill(ctx: DrillContext) -> tuple[DrillResult, DimensionResult]:
    """SIGKILL one rank mid-training; torchrun's restart or a relaunch resumes from the last complete checkpoint."""
    train, job, release = _past_first_checkpoint(ctx, "drill-rank-kill")
    victim, coords = kill_victim(job.ranks_record().ranks)
    job.kill_rank(victim)
    t_fail = time.time()
    release()
    killed_at = last_step(job.output_dir)
    checkpoint = max((s for s in committed_steps(train) if s <= killed_at), default=None)
    outcome = job.wait(ctx.acceptance.job_timeout_s)
    relaunched = not outcome.ok
    if relaunched:  # no elastic restart configured (or it gave up): relaunch, as an operator would
        outcome = ctx.job(train, "drill-rank-kill").wait(ctx.acceptance.job_timeout_s)
    recovery = ctx.recovery(outcome, checkpoint)
    result = _finish(
        "rank_kill", recovery, t_fail, outcome, killed_at - (checkpoint or 0),
        {"killed_rank": victim, "killed_rank_coords": coords, "killed_at_step": killed_at,
         "checkpoint_step": checkpoint, "relaunched": relaunched},
    )  # fmt: skip
    return result, recovery


def drill_preemption(ctx: DrillContext) -> DrillResult:
    """SIGTERM to the job through its launcher, as a scheduler sends it before taking the nodes back: the ranks
    finish their step, checkpoint it and the job ends `preempted` with its record (preemptions.jsonl); the
    resubmitted job goes on with the next step (0 steps lost) and matches the uninterrupted run.

    The job runs without elastic restarts, as a scheduler's requeue would: the resubmission is the recovery. A
    job that stops any other way (a handler that exits without the checkpoint) fails the drill with the steps
    it lost: trained before the stop, trained again after the resume.
    """
    if not registry.capabilities(ctx.cluster.scheduler).delivers_signals:
        return DrillResult("preemption", None, message=f"skipped: the {ctx.cluster.scheduler} launcher cannot "
                           "deliver signals (preempt such jobs through the scheduler)")  # fmt: skip
    name = "drill-preemption"
    no_restart = ctx.cluster.model_copy(update={"max_restarts": 0})
    # The ranks are released as the signal leaves: a save interval past the hold gives it room to reach them
    # before the job would end by itself, and the resubmission trains drills.relaunch_steps past that.
    every = ctx.acceptance.save_every_steps
    train, job, release = _past_first_checkpoint(ctx, name, cluster=no_restart, stop_after=2 * every + 1)
    held_at = last_step(job.output_dir)
    job.launcher.signal(job.handle, signal.SIGTERM)
    t_fail = time.time()
    release()
    stopped = job.wait(ctx.acceptance.job_timeout_s)
    stopped_at = last_step(job.output_dir)  # the last step the signalled job trained
    records = preemption_records(str(stopped.output_dir), job.handle.submitted_unix_s)
    record = records[-1] if records else None
    committed = [s for s in committed_steps(train) if s <= stopped_at]
    checkpoint = record.step if record is not None else max(committed, default=None)
    resumed = ctx.job(train, name).wait(ctx.acceptance.job_timeout_s)  # the resubmission
    recovery = ctx.recovery(resumed, checkpoint)
    resumed_from = recovery.figures_as(RecoveryFigures).resumed_from_step
    lost = stopped_at - (resumed_from or 0)
    result = _finish(
        "preemption", recovery, t_fail, resumed, lost,
        {"signal": "SIGTERM", "held_at_step": held_at, "stopped_at_step": stopped_at,
         "state": stopped.status.state.value, "exit_code": stopped.status.exit_code,
         "preemption": None if record is None else asdict(record), "checkpoint_step": checkpoint},
    )  # fmt: skip
    problems = []
    if stopped.status.state is not JobState.PREEMPTED:
        problems.append(f"the signalled job ended {stopped.status.describe()}, not preempted")
    if record is None:
        problems.append("it left no preemption record (its checkpoint at the step boundary was never written)")
    if lost:
        problems.append(f"{lost} step(s) lost: it trained to step {stopped_at}, the resubmitted job resumed from "
                        f"{'nothing' if resumed_from is None else f'step {resumed_from}'}")  # fmt: skip
    if problems:
        result.passed = False
        result.message = "; ".join([*problems, *([result.message] if result.message else [])])
    return result


SAVE_CHAIN = "drill-kill-during-save"


@dataclass
class SavePhaseOutcome:
    """kill_during_save at one phase: what the kill left on storage and what the relaunch resumed from."""

    phase: SavePhase
    save_step: int
    expected_step: int  # where a relaunch must resume: the previous checkpoint until COMMIT.json, then this one
    output_dir: str = ""  # the job that was stopped and killed
    files_at_kill: list[str] = field(default_factory=list)  # the stopped save's folder when every rank was killed
    resumed_from: int | None = None
    whole: bool = False  # the checkpoint the relaunch resumes from (the newest committed one) is whole
    partial_skipped_with_warning: bool | None = None  # None after the commit: nothing partial to skip
    state_matched: bool | None = None
    recovery_s: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Nothing was wrong."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """As a dict (with `passed`)."""
        return {**asdict(self), "passed": self.passed}


def _stopped_save(
    ctx: DrillContext, name: str, train: TrainConfig, phase: SavePhase, save_step: int
) -> tuple[RunOutcome, float | None, str]:
    """Run `train` until every rank has stopped at `phase` of the save of `save_step`, then SIGKILL them all.

    Returns the job's outcome, the time of the kill and, when the ranks never all stopped, why (kill time None).
    """
    markers = str(ctx.root / name / "save-pause")
    pause = {"phase": phase, "step": save_step, "marker_dir": markers}
    no_restart = ctx.cluster.model_copy(update={"max_restarts": 0})  # the next launch is the recovery
    job = ctx.job(train, name, cluster=no_restart, environment=ctx.environment.with_drill_points(pause_in_save=pause))
    try:
        job.wait_until(
            lambda: len(paused_ranks(markers)) == ctx.cluster.world_size,
            f"every rank stopped at {phase} of the save of step {save_step}", ctx.acceptance.job_timeout_s, 0.1,
        )  # fmt: skip
    except UserError as err:
        ended = job.status().state.terminal
        if not ended:
            job.cancel()
        outcome = job.wait(ctx.acceptance.job_timeout_s)
        why = f"the job {outcome.status.describe()}" if ended else str(err)
        return outcome, None, f"the ranks never all stopped at {phase} of the save of step {save_step}: {why}"
    for rank in paused_ranks(markers):
        try:
            job.kill_rank(rank.rank)
        except ProcessLookupError:
            pass
    t_kill = time.time()
    return job.wait(ctx.acceptance.job_timeout_s), t_kill, ""


def _inspect_kill(outcome: SavePhaseOutcome, train: TrainConfig) -> None:
    """What the kill left: the stopped save's files, and the newest committed checkpoint, which must be whole."""
    manager = CheckpointManager(train.checkpoint, train.storage)
    outcome.files_at_kill = manager.files(outcome.save_step)
    newest = max(committed_steps(train), default=None)
    if newest != outcome.expected_step:
        when = "after" if outcome.phase == "after_commit" else "before"
        outcome.problems.append(
            f"after the kill the newest committed checkpoint is step {newest}, expected step "
            f"{outcome.expected_step} (the save of step {outcome.save_step} was killed {when} its {COMMIT} was due)"
        )
    if newest is not None:
        missing = manager.wholeness(newest)
        outcome.whole = not missing
        if missing:
            outcome.problems.append(f"{step_dir_name(newest)} is not whole: {'; '.join(missing)}")


def _judge_relaunch(
    ctx: DrillContext, killed: SavePhaseOutcome, t_kill: float, relaunch: RunOutcome, stopped: bool
) -> None:
    """The launch after a kill resumed from the expected checkpoint, passed over the partial one, and matched."""
    if not stopped and not relaunch.ok:
        killed.problems.append(f"the relaunch {relaunch.status.describe()}")
    if relaunch.run.ranks() is None:
        return  # it never got to training (the problem above says why)
    recovery = ctx.recovery(relaunch, killed.expected_step)
    killed.resumed_from = recovery.figures_as(RecoveryFigures).resumed_from_step
    killed.state_matched = recovery.passed
    if not recovery.passed:
        killed.problems.append(recovery.message)
    if killed.resumed_from is not None:
        first = first_step_time_after(relaunch.output_dir, killed.resumed_from + 1, t_kill)
        killed.recovery_s = None if first is None else first - t_kill
    if killed.phase != "after_commit":
        killed.partial_skipped_with_warning = _skipped_for(relaunch, killed.save_step, "partial")
        if not killed.partial_skipped_with_warning:
            killed.problems.append(
                f"the resume did not record skipping the partial checkpoint of step {killed.save_step}"
            )


def drill_kill_during_save(ctx: DrillContext) -> DrillResult:
    """SIGKILL every rank at each point of a save; each relaunch resumes from a whole checkpoint: the previous
    one while the save is uncommitted, the new one once its COMMIT.json is written.

    The phases (drills.save_phases, in protocol order) share one checkpoint folder and one chain of launches:
    the launch that relaunches after a kill is itself stopped at the next phase of the same save (of step
    2 x save_every_steps), the last one trains drills.relaunch_steps past its resume point. Every launch has
    its own output folder, so what a relaunch records is never an earlier launch's.
    """
    every = ctx.acceptance.save_every_steps
    save_step = 2 * every  # the second save, so that a committed checkpoint precedes it
    needed = save_step + ctx.drills.relaunch_steps
    if needed > ctx.acceptance.steps:
        return DrillResult(
            "kill_during_save", False,
            message=f"acceptance.steps={ctx.acceptance.steps} is too short: the drill stops the save of step "
            f"{save_step} and relaunches for drills.relaunch_steps={ctx.drills.relaunch_steps}; "
            f"use acceptance.steps >= {needed}",
        )  # fmt: skip
    phases = [p for p in SAVE_PHASES if p in ctx.drills.save_phases]

    def resume_point(phase: SavePhase) -> int:
        return save_step if phase == "after_commit" else every

    checkpoints = {"url": str(ctx.root / SAVE_CHAIN / "checkpoints")}
    outcomes: list[SavePhaseOutcome] = []
    killed: tuple[SavePhaseOutcome, float] | None = None  # the last kill, judged by the launch after it
    for k, phase in enumerate([*phases, None]):
        name = f"{SAVE_CHAIN}-{k}-{(phase or 'relaunch').replace('_', '-')}"
        if phase is None:
            assert killed is not None  # every earlier phase was killed, or the loop broke
            last = killed[0].expected_step + ctx.drills.relaunch_steps
        else:
            last = save_step + 1
        train = ctx.train(name, run={"stop_after_steps": last}, checkpoint=checkpoints)
        if phase is None:
            launched, t_kill, why = ctx.job(train, name).wait(ctx.acceptance.job_timeout_s), None, ""
        else:
            launched, t_kill, why = _stopped_save(ctx, name, train, phase, save_step)
        if killed is not None:
            _judge_relaunch(ctx, *killed, launched, stopped=t_kill is not None)
        if phase is None:
            break
        outcome = SavePhaseOutcome(phase, save_step, resume_point(phase), str(launched.output_dir))
        outcomes.append(outcome)
        if t_kill is None:
            outcome.problems.append(why)
            break
        _inspect_kill(outcome, train)
        killed = (outcome, t_kill)
    for phase in phases[len(outcomes) :]:
        not_run = f"not run: the chain of launches broke at {outcomes[-1].phase}"
        outcomes.append(SavePhaseOutcome(phase, save_step, resume_point(phase), problems=[not_run]))
    failed = [o for o in outcomes if not o.passed]
    times = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    return DrillResult(
        name="kill_during_save",
        passed=not failed,
        recovery_s=max(times) if times else None,
        steps_lost=max(o.save_step - o.expected_step for o in outcomes),
        state_matched=all(o.state_matched for o in outcomes),
        message="; ".join(f"killed at {o.phase}: {'; '.join(o.problems)}" for o in failed),
        evidence={"save_step": save_step, "checkpoints": checkpoints["url"], "phases": [o.to_json() for o in outcomes]},
    )


def _reference_checkpoints(ctx: DrillContext) -> TrainConfig:
    """The drills' base config reading the reference run's checkpoint folder."""
    reference = ctx.reference()
    assert reference.checkpoint_url is not None, "the drills' reference is a Job's outcome or the acceptance run's"
    return ctx.base.model_copy(
        update={"checkpoint": ctx.base.checkpoint.model_copy(update={"url": reference.checkpoint_url})}
    )


def copy_checkpoints(source: TrainConfig, target: TrainConfig, up_to: int | None = None) -> list[int]:
    """Copy `source`'s committed checkpoints (those up to step `up_to`; None: all) into `target`'s fresh checkpoint
    folder by the commit protocol (`copy_step`: only the files COMMIT.json lists, each checked against its record);
    the steps copied. CheckpointCopyError names a source file that differs from its record."""
    copied = [step for step in committed_steps(source) if up_to is None or step <= up_to]
    manager = CheckpointManager(source.checkpoint, source.storage)
    for step in copied:
        copy_step(manager.step_url(step), target.checkpoint.url, target.storage)
    return copied


def _copy_reference_checkpoints(ctx: DrillContext, target: TrainConfig, up_to: int | None = None) -> list[int]:
    """Copy the reference run's committed checkpoints (up to step `up_to`; None: all) into `target`'s folder."""
    return copy_checkpoints(_reference_checkpoints(ctx), target, up_to)


def drill_corrupt_checkpoint(ctx: DrillContext) -> DrillResult:
    """Flip bytes in the newest checkpoint; it is detected by its checksums and skipped; the previous one is used."""
    train = ctx.train("drill-corrupt")
    steps = _copy_reference_checkpoints(ctx, train)
    if len(steps) < 2:
        return DrillResult("corrupt_checkpoint", False, message="the reference run left fewer than 2 checkpoints")
    train = ctx.train("drill-corrupt", run=ctx.stop_after(steps[-2]))  # the same folders, stopping past the resume
    newest = Path(train.checkpoint.url) / step_dir_name(steps[-1])
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    t_fail = time.time()
    job = ctx.job(train, "drill-corrupt")
    outcome = job.wait(ctx.acceptance.job_timeout_s)
    warned = _skipped_for(outcome, steps[-1], "corrupt")
    recovery = ctx.recovery(outcome, steps[-2])
    result = _finish(
        "corrupt_checkpoint", recovery, t_fail, outcome, steps[-1] - steps[-2],
        {"corrupted": str(shard), "detected_and_skipped": warned},
    )  # fmt: skip
    if not warned:
        result.passed = False
        result.message = (result.message + "; " if result.message else "") + "the corrupt checkpoint was not reported"
    return result


def drill_reshard(ctx: DrillContext) -> DrillResult:
    """Restore a checkpoint on another layout (global batch kept): model and optimizer state carry over.

    A data-parallel job's checkpoint of N ranks is restored on one rank. A model-parallel job's (TP2xDP2,
    PP2xDP2, EP2) is restored on pure data parallelism over the same processes (DP4: every stage-local and
    shard-local name maps to the whole model's), and on one rank where its global batch does not divide
    over them.

    The resharded run is compared with the uninterrupted run. With dropout it cannot be: each rank draws its
    masks from its own RNG stream, which one rank cannot reproduce. Then both the resharded run and a control
    (the same checkpoint resumed on the original layout, which the other drills compare bit for bit with the
    uninterrupted run) train a few steps without dropout, and the resharded run must match the control.
    """
    if ctx.cluster.world_size < 2:
        return DrillResult("reshard", None, message="needs a world size of 2 or more to reshard from")
    reference = ctx.reference()
    flat = data_parallel_layout(ctx.cluster, ctx.base)
    if flat is not None:
        to_cluster, sections = ctx.cluster, {"parallel": flat, "run": {}}
    else:
        to_cluster, sections = single_process(ctx.cluster, ctx.base)
    train = ctx.train("drill-reshard", **sections)
    steps = committed_steps(_reference_checkpoints(ctx))
    midpoint = steps[len(steps) // 2 - 1] if len(steps) >= 2 else None
    if midpoint is None:
        return DrillResult("reshard", False, message="the reference run left fewer than 2 checkpoints")
    _copy_reference_checkpoints(ctx, train, up_to=midpoint)
    control = None
    if ctx.base.model.dropout > 0:
        quiet = {"model": {"dropout": 0.0}}
        stop = {"stop_after_steps": min(ctx.base.run.steps, midpoint + max(5, ctx.drills.relaunch_steps))}
        train = ctx.train("drill-reshard", **{**sections, **quiet, "run": {**sections["run"], **stop}})
        control_train = ctx.train("drill-reshard-control", **quiet, run=stop)
        _copy_reference_checkpoints(ctx, control_train, up_to=midpoint)
        control = ctx.job(control_train, "drill-reshard-control").wait(ctx.acceptance.job_timeout_s)
        if not control.ok:
            return DrillResult(
                "reshard", False, message=f"the same-layout control run failed: {control.status.describe()}",
                evidence={"output_dir": str(control.output_dir)},
            )  # fmt: skip
    t_fail = time.time()
    job = ctx.job(train, "drill-reshard", cluster=to_cluster)
    outcome = job.wait(ctx.acceptance.job_timeout_s)
    resumed = outcome.run.resume()
    from_layout = Layout.of(ctx.base.parallel, ctx.cluster.world_size, ctx.cluster.procs_per_node).degrees()
    to_layout = Layout.of(train.parallel, to_cluster.world_size, to_cluster.procs_per_node).degrees()
    # Same processes, other layout: every rank finds its own RNG file, so the manager may not call it resharded
    reported = resumed is not None and resumed.resharded
    resharded = resumed is not None and resumed.loaded_step == midpoint and (reported or from_layout != to_layout)
    if control is None:
        recovery = ctx.recovery(outcome, midpoint, bit_identical=False)
    else:
        resumed_from = outcome.ranks().ranks[0]["resumed_from_step"]
        recovery = check_recovery(control.metrics(), outcome.metrics(), midpoint, resumed_from, bit_identical=False)
    result = _finish(
        "reshard", recovery, t_fail, outcome, 0,
        {"from_world_size": ctx.cluster.world_size, "to_world_size": to_cluster.world_size,
         "from_layout": from_layout, "to_layout": to_layout, "checkpoint_step": midpoint,
         "reshard_reported": reported, "reference_world_size": reference.ranks().world_size,
         "compared_with": "uninterrupted run" if control is None else f"same-layout resume {control.output_dir}"},
    )  # fmt: skip
    if not resharded:
        result.passed = False
        result.message = (result.message + "; " if result.message else "") + (
            f"the {to_layout} job did not resume from the {from_layout} checkpoint of step {midpoint}"
        )
    return result


def drill_storage_outage(ctx: DrillContext) -> DrillResult:
    """Cut the object store during a save: retried, then lost loudly; training goes on; the next save succeeds.

    The job holds twice (training.drill_points.StepHold): after its first save, committed, while the store goes
    down, and after the save of the next one, failed, while it comes back; it stops drills.relaunch_steps past
    the save after that, and every step it trained must match the uninterrupted run."""
    import boto3
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "drill")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the drill's own endpoint: no request log per S3 call
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = TcpProxy(*server.get_host_and_port())
    name, every, timeout_s = "drill-storage-outage", ctx.acceptance.save_every_steps, ctx.acceptance.job_timeout_s
    before, after = ctx.root / name / "hold-before-outage", ctx.root / name / "hold-after-outage"

    def held(markers: Path) -> bool:
        return len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == ctx.cluster.world_size

    try:
        boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1").create_bucket(Bucket="tdeploy-drill")
        train = ctx.train(
            name,
            checkpoint={"url": "s3://tdeploy-drill/checkpoints", "continue_on_save_failure": True,
                        "save_retries": 1, "save_retry_backoff_s": 0.5},
            storage={"s3_endpoint_url": proxy.url, "options": {"config_kwargs": {"retries": {"max_attempts": 1}}}},
            run=ctx.stop_after(3 * every),
        )  # fmt: skip
        holds = ctx.environment.with_drill_points(
            hold_after_step={"step": every, "marker_dir": str(before), "timeout_s": timeout_s},
            hold_again_after_step={"step": 2 * every, "marker_dir": str(after), "timeout_s": timeout_s},
        )
        job = ctx.job(train, name, environment=holds)
        job.wait_until(lambda: held(before), f"every rank past the first save (step {every})", timeout_s)
        if every not in committed_steps(train):
            job.cancel()
            return DrillResult("storage_outage", False, message=f"the first save (step {every}) did not commit "
                               f"before the outage: see the job's checkpoint events in {job.output_dir}")  # fmt: skip
        proxy.down()
        t_down = time.time()
        (before / RELEASE_FILE).touch()

        def failed_saves() -> list[CheckpointEvent]:
            return [e for e in job.run.checkpoints() if e.error is not None and e.step > every]

        job.wait_until(lambda: held(after), f"every rank past the save of step {2 * every}", timeout_s)
        failed = failed_saves()
        lost = failed[0].step if failed else None
        proxy.up()
        t_up = time.time()
        (after / RELEASE_FILE).touch()
        if lost is None:
            job.wait(timeout_s)
            return DrillResult("storage_outage", False, message=f"the save of step {2 * every} did not fail "
                               "during the outage (checkpoints.jsonl records no error)")  # fmt: skip
        job.wait_until(lambda: any(s > lost for s in committed_steps(train)), "a save after the outage", timeout_s)
        t_back = time.time()
        outcome = job.wait(timeout_s)
        ref = ctx.reference().metrics()
        got = outcome.metrics()
        last = train.run.stop_after_steps or train.run.steps
        trained = {s for s in ref if s <= last}
        matched = outcome.ok and all(got[s].loss == ref[s].loss for s in ref if s in got) and set(got) == trained
        lost_committed = lost in committed_steps(train)
        return DrillResult(
            "storage_outage",
            passed=outcome.ok and matched and not lost_committed,
            recovery_s=t_back - t_up,
            steps_lost=0,
            state_matched=matched,
            message="" if outcome.ok and matched and not lost_committed else
            f"job {outcome.status.describe()}; losses match: {matched}; lost save committed: {lost_committed}",
            evidence={"outage_s": t_up - t_down, "failed_save_step": lost, "steps_trained": last,
                      "error": (failed[0].error or "")[:300]},
        )  # fmt: skip
    finally:
        proxy.close()
        server.stop()


def drill_node_loss(ctx: DrillContext) -> DrillResult:
    """SIGKILL every process of the last node mid-training (its agent and its workers at once, as when a host
    dies). An elastic job (cluster.min_nodes) goes on by itself on the remaining nodes from the last complete
    checkpoint; otherwise the job fails and is relaunched, on a spare host in place of the lost one where the
    SSH inventory lists more hosts than cluster.nodes, which gives the same world and so the same losses."""
    cluster = ctx.cluster
    launcher = registry.launcher_class(cluster.scheduler)
    if cluster.nodes < 2 or not launcher.capabilities.can_lose_node:
        why = "needs cluster.nodes >= 2" if cluster.nodes < 2 else f"not drilled on scheduler {cluster.scheduler}"
        able = " or ".join(name for name in registry.names() if registry.capabilities(name).can_lose_node)
        return DrillResult("node_loss", None, message=f"skipped: {why} ({able})")
    train, job, release = _past_first_checkpoint(ctx, "drill-node-loss")
    lost = job.kill_node(cluster.nodes - 1)
    t_fail = time.time()
    release()
    killed_at = last_step(job.output_dir)
    checkpoint = max((s for s in committed_steps(train) if s <= killed_at), default=None)
    outcome = job.wait(ctx.acceptance.job_timeout_s)
    elastic = cluster.min_nodes is not None and cluster.min_nodes < cluster.nodes and outcome.ok
    if elastic:
        written = outcome.run.ranks_written_at()
        detection = None if written is None or written < t_fail else written - t_fail
        relaunch_cluster = None
    else:
        detection = time.time() - t_fail  # the job ended: every survivor noticed
        relaunch_cluster = launcher.relaunch_cluster(cluster, lost["host"])
        outcome = ctx.job(train, "drill-node-loss", cluster=relaunch_cluster).wait(ctx.acceptance.job_timeout_s)
    world = outcome.ranks().world_size
    same_world = world == cluster.world_size
    # A smaller world is another global batch: the losses cannot match the uninterrupted run, the resume point can.
    if same_world:
        recovery = ctx.recovery(outcome, checkpoint)
    else:
        resumed_from = outcome.ranks().ranks[0]["resumed_from_step"]
        recovery = check_recovery({}, outcome.metrics(), checkpoint, resumed_from)
    # Same world: every rank must go on with exactly the samples it would have had (no step skipped or repeated
    # across the lost host and its replacement); a smaller world draws another order, so only the resume counts.
    data = check_data_consistency(outcome.output_dir, Sampling.of(train, world)) if same_world else None
    hosts = sorted({r["host"] for r in outcome.ranks().ranks})
    result = _finish(
        "node_loss", recovery, t_fail, outcome, killed_at - (checkpoint or 0),
        {"lost": lost, "killed_at_step": killed_at, "checkpoint_step": checkpoint, "elastic": elastic,
         "relaunched_on": None if relaunch_cluster is None else _host_names(launcher.hosts(relaunch_cluster)),
         "world_after": world, "hosts_after": hosts, "losses_compared": same_world,
         "data_consistency": None if data is None else {"passed": data.passed, "message": data.message}},
    )  # fmt: skip
    result.detection_s = detection
    if result.passed and data is not None and not data.passed:
        result.passed, result.message = False, f"data consistency across the lost host's resume: {data.message}"
    if result.passed and lost["host"] in hosts and launcher.capabilities.replaces_lost_host:
        result.passed, result.message = False, f"the lost host {lost['host']} is still in the job's ranks"
    return result


def _host_names(hosts: list[NodeHost] | None) -> list[str] | None:
    return None if hosts is None else [h.name for h in hosts]
