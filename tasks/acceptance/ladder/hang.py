"""The hang drill: one rank stops progressing inside a step, short of its collective, and the others block in it.

The job runs with torchrun restarts (cluster.max_restarts >= 1) and a short step timeout derived from the
uninterrupted reference run's own slowest step. It passes when the watchdog (training/watchdog.py) found the
hang in phase step at the stalled step, named the stalled rank as the one that did not arrive, every rank
dumped its stacks, and the restarted job (torchrun's restart; or the drill's relaunch where the launcher ended
the job instead) finished with the state of the uninterrupted run (resumed from the last checkpoint before the
hang). Everything is read from the records the job wrote for this purpose:
hangs.jsonl and the stack dumps (watchdog), the drill point's marker (when the rank stopped), the metrics.
"""

from __future__ import annotations

from typing import Any

from tasks.acceptance.drills import DrillContext, _finish, committed_steps, kill_victim
from tasks.acceptance.record import DrillResult
from training.drill_points import HANG_MARKER_PREFIX, paused_ranks
from training.recovery_record import recovery_events
from training.watchdog import HangRecord, hang_records, stack_dumps

NAME = "hang"
TIMEOUT_FLOOR_S = 5.0
"""The drill job's step timeout is never shorter than this (a busy CI machine deschedules a rank for seconds)."""
TIMEOUT_FACTOR = 20.0
"""...and never shorter than this many times the reference run's slowest step."""


def drill_timeout_s(ctx: DrillContext) -> float:
    """The drill job's step timeout floor: max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR x the reference's slowest step)."""
    slowest = max((r.step_time_s for r in ctx.reference().metrics().values() if r.step_time_s), default=0.0)
    return max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * slowest)


def _detected(records: list[HangRecord]) -> HangRecord | None:
    """The first attempt's first hang found by a rank's own phase clock (peers that dumped on its mark say so)."""
    return next((r for r in records if r.attempt == 0 and r.detected_by == "timeout"), None)


def drill_hang(ctx: DrillContext) -> DrillResult:
    """Stop one rank before the loss all-reduce of a step past the first checkpoint; judge detection and recovery."""
    cluster = ctx.cluster.model_copy(update={"max_restarts": max(1, ctx.cluster.max_restarts)})
    if cluster.world_size < 2:
        return DrillResult(NAME, None, message="skipped: needs a world size of 2 or more (a rank to wait for)")
    reference = ctx.reference()
    victim, coords = kill_victim(reference.ranks().ranks)
    hang_step = ctx.acceptance.save_every_steps + 2  # one full step after the first checkpoint's step
    floor = drill_timeout_s(ctx)
    name = "drill-hang"
    stop = ctx.stop_after(hang_step)  # the restart trains drills.relaunch_steps past the hang, then stops
    train = ctx.train(name, watchdog={"step_timeout_s": None, "step_timeout_floor_s": floor}, run=stop)
    markers = ctx.root / name / "hang"
    point = {"step": hang_step, "rank": victim, "marker_dir": str(markers)}
    job = ctx.job(train, name, cluster=cluster, environment=ctx.environment.with_drill_points(hang_in_step=point))
    outcome = job.wait(ctx.acceptance.job_timeout_s)
    records = hang_records(outcome.output_dir)
    found = _detected(records)
    relaunched = found is not None and not outcome.ok
    if relaunched:  # the launcher ended the job instead of restarting it: relaunch it, as an operator would
        outcome = ctx.job(train, name, cluster=cluster).wait(ctx.acceptance.job_timeout_s)
    stalled = next((m for m in paused_ranks(str(markers), HANG_MARKER_PREFIX) if m.rank == victim), None)
    stacks = stack_dumps(outcome.output_dir, 0)
    checkpoint = max((s for s in committed_steps(train) if s < hang_step), default=None)
    evidence: dict[str, Any] = {
        "stalled_rank": victim, "stalled_rank_coords": coords, "stalled_at_step": hang_step,
        "step_timeout_floor_s": floor, "checkpoint_step": checkpoint,
        "hang": None if found is None else {
            "phase": found.phase, "step": found.step, "rank": found.rank, "late_ranks": found.late_ranks,
            "message": found.message, "elapsed_s": found.elapsed_s, "timeout_s": found.timeout_s,
            "timeout_rule": found.timeout_rule, "last_collective_seq": found.last_collective_seq,
        },
        "hang_records": len(records), "relaunched": relaunched,
        "stacks": {str(rank): str(path) for rank, path in stacks.items()},
    }  # fmt: skip
    if found is None:
        return DrillResult(
            NAME, False, message=f"no hang was recorded in {outcome.output_dir}/hangs.jsonl: the job "
            f"{outcome.status.describe()}", evidence=evidence | {"output_dir": str(outcome.output_dir)},
        )  # fmt: skip
    # The restart's rung as the trainer recorded it: a storage restore resumes from `checkpoint`; a memory restore
    # (checkpoint.memory_every_steps on) from the host-memory copy it names.
    # (the first event is the job's own start; the next one is torchrun's restart or the relaunch's start)
    restart = next(iter(recovery_events(train.run.output_url)[1:]), None)
    if restart is not None:
        evidence["restart"] = {"rung": restart.rung, "restored_step": restart.restored_step,
                               "restore_s": restart.restore_s}  # fmt: skip
        if restart.rung == "memory":
            checkpoint = restart.restored_step
    recovery = ctx.recovery(outcome, checkpoint)
    resumed_from = outcome.ranks().ranks[0]["resumed_from_step"] if outcome.ok else None
    lost = None if resumed_from is None else (hang_step - 1) - resumed_from
    result = _finish(NAME, recovery, found.time_unix_s, outcome, lost, evidence)
    result.detection_s = None if stalled is None else round(found.time_unix_s - stalled.time_unix_s, 3)
    problems = []
    if (found.phase, found.step) != ("step", hang_step):
        problems.append(f"the hang was found in phase {found.phase} at step {found.step}, not in step {hang_step}")
    if found.late_ranks != [victim]:
        problems.append(f"the record names ranks {found.late_ranks} as not arrived, not the stalled rank {victim}")
    missing = sorted(set(range(cluster.world_size)) - set(stacks))
    if missing:
        problems.append(f"no stack dump of rank(s) {missing}")
    if stalled is None:
        problems.append(f"the stalled rank {victim} left no marker in {markers} (the drill point did not fire)")
    if problems:
        result.passed = False
        result.message = "; ".join(([result.message] if result.message else []) + problems)
    return result
