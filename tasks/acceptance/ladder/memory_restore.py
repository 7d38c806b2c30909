"""The memory_restore drill: a node is lost past a storage checkpoint; the job recovers from the host-memory copies
(its own and the lost node's peer copies on the surviving node), with the storage out of reach during the restore.

The lost node's memory folder is wiped (its host memory is gone with it) and the checkpoint step folders are moved
aside until the job has recovered: a restore that reads storage finds nothing there, starts afresh and fails the
drill, and so does a resume record (resume.json: written only by a storage restore) written after the kill.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

from tasks.acceptance.drills import DrillContext, committed_steps
from tasks.acceptance.record import DrillResult
from tasks.acceptance.workspace import first_step_time_after, last_step
from tasks.launch import registry
from training.checkpoint import step_dir_name
from training.checkpoint.memory import node_folder
from training.config import TrainConfig
from training.drill_points import HOLD_MARKER_PREFIX, RELEASE_FILE, paused_ranks
from training.recovery_record import RecoveryEvent, recovery_events
from training.run_output import RunOutput
from validation.acceptance import check_recovery

NAME = "memory_restore"
JOB = "drill-memory-restore"
MEMORY_EVERY_STEPS = 1


def hold_step(save_every: int) -> int:
    """Where the node is lost: past the first storage checkpoint, with up to 3 steps done since (before the
    next one)."""
    return save_every + max(1, min(3, save_every - 1))


def _stash_storage(train: TrainConfig, aside: Path) -> list[int]:
    """Move every checkpoint step folder into `aside` (the lease files stay): storage holds nothing to restore."""
    root = Path(train.checkpoint.url)
    aside.mkdir(parents=True, exist_ok=True)
    moved = []
    for step in committed_steps(train):
        shutil.move(str(root / step_dir_name(step)), str(aside / step_dir_name(step)))
        moved.append(step)
    return moved


def _unstash_storage(train: TrainConfig, aside: Path, moved: list[int]) -> None:
    root = Path(train.checkpoint.url)
    for step in moved:
        if not (root / step_dir_name(step)).exists():
            shutil.move(str(aside / step_dir_name(step)), str(root / step_dir_name(step)))


def drill_memory_restore(ctx: DrillContext) -> DrillResult:
    """SIGKILL every process of the last node past a storage checkpoint; the job must restore from the peers'
    host-memory copies (recovery.jsonl rung "memory") with no storage read, losing no step beyond the memory
    interval, and train on as the uninterrupted run did."""
    cluster = ctx.cluster
    launcher = registry.launcher_class(cluster.scheduler)
    if cluster.nodes < 2 or not launcher.capabilities.can_lose_node or not ctx.base.checkpoint.url.startswith("/"):
        able = " or ".join(name for name in registry.names() if registry.capabilities(name).can_lose_node)
        why = (
            f"not drilled on scheduler {cluster.scheduler}: its launcher cannot lose one node of a running job "
            f"(needs a node to lose: {able})" if not launcher.capabilities.can_lose_node
            else "needs cluster.nodes >= 2 (a surviving node keeps the lost one's copies in host memory)"
            if cluster.nodes < 2
            else "needs a local checkpoint folder (the drill moves its steps aside during the restore)"
        )  # fmt: skip
        return DrillResult(NAME, None, message=f"skipped: {why}")
    train = ctx.train(JOB, checkpoint={"memory_every_steps": MEMORY_EVERY_STEPS})
    out = Path(train.run.output_url)
    held_at = hold_step(ctx.acceptance.save_every_steps)
    markers = ctx.root / JOB / "hold"
    hold = {"step": held_at, "marker_dir": str(markers), "timeout_s": ctx.acceptance.job_timeout_s}
    job = ctx.job(train, JOB, environment=ctx.environment.with_drill_points(hold_after_step=hold))
    job.wait_until(
        lambda: len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == cluster.world_size,
        f"every rank at step {held_at}", ctx.acceptance.job_timeout_s,
    )  # fmt: skip
    killed_at = last_step(job.output_dir)
    checkpoint = max((s for s in committed_steps(train) if s <= killed_at), default=None)
    aside = ctx.root / JOB / "storage-aside"
    moved = _stash_storage(train, aside)
    (out / "resume.json").unlink(missing_ok=True)
    try:
        lost = job.kill_node(cluster.nodes - 1, signal.SIGKILL)
        t_fail = time.time()
        lost_node = min(lost["ranks"]) // cluster.procs_per_node if lost["ranks"] else cluster.nodes - 1
        shutil.rmtree(node_folder(train.checkpoint, lost_node), ignore_errors=True)  # its host memory is gone
        (markers / RELEASE_FILE).touch()
        outcome = job.wait(ctx.acceptance.job_timeout_s)
        elastic = cluster.min_nodes is not None and cluster.min_nodes < cluster.nodes and outcome.ok
        detection = time.time() - t_fail
        if elastic:
            written = outcome.run.ranks_written_at()
            detection = None if written is None or written < t_fail else written - t_fail
        else:
            relaunched = launcher.relaunch_cluster(cluster, lost["host"])
            outcome = ctx.job(train, JOB, cluster=relaunched).wait(ctx.acceptance.job_timeout_s)
    finally:
        _unstash_storage(train, aside, moved)
    events = [e for e in recovery_events(str(out)) if e.time >= t_fail]
    event: RecoveryEvent | None = events[0] if events else None
    storage_read = RunOutput(out).resume() is not None
    world = outcome.ranks().world_size if outcome.ok else None
    same_world = world == cluster.world_size
    resumed_from = event.restored_step if event is not None else None
    newest_copy = killed_at - killed_at % MEMORY_EVERY_STEPS  # the last in-memory copy before the kill
    if same_world:
        recovery = ctx.recovery(outcome, newest_copy)
    elif outcome.ok:  # a smaller world (elastic): another global batch, so only the resume point counts
        recovery = check_recovery({}, outcome.metrics(), newest_copy, outcome.ranks().ranks[0]["resumed_from_step"])
    else:
        recovery = check_recovery({}, {}, newest_copy, None)
    steps_lost = None if resumed_from is None else killed_at - resumed_from
    t_first = first_step_time_after(out, resumed_from + 1, t_fail) if resumed_from is not None else None
    problems = []
    if not outcome.ok:
        problems.append(f"the recovered job {outcome.status.describe()}")
    if event is None or event.rung != "memory":
        got = "no recovery event" if event is None else f"rung {event.rung!r} ({event.reason or 'no reason'})"
        problems.append(f"the job did not restore from memory: {got}")
    if storage_read:
        problems.append("the restore read storage (resume.json was written after the kill)")
    if steps_lost is not None and steps_lost > MEMORY_EVERY_STEPS:
        problems.append(f"{steps_lost} steps lost, more than checkpoint.memory_every_steps={MEMORY_EVERY_STEPS}")
    if not recovery.passed:
        problems.append(recovery.message)
    return DrillResult(
        NAME,
        passed=not problems,
        recovery_s=None if t_first is None else t_first - t_fail,
        detection_s=detection,
        steps_lost=steps_lost,
        state_matched=recovery.passed if same_world else None,
        message="; ".join(problems),
        evidence={
            "output_dir": str(out), "lost": lost, "killed_at_step": killed_at, "storage_checkpoint_step": checkpoint,
            "storage_steps_moved_aside": moved, "elastic": elastic, "world_after": world,
            "recovery_event": None if event is None else event.to_json(),
        },
    )  # fmt: skip
