"""The replica_loss drill: one replica group loses its workers mid-training (SIGKILL); its torchrun restarts them
and they pull the state from the healthy group (rung "live" in recovery.jsonl), while the healthy group trains on
without reloading.

Passes when the healthy group's steps run 1..N once each, in order, and it recorded no restore after its start;
the lost group recorded a "live" recovery after the kill and no restore from memory or storage; no step was lost
(the pulled step is at least the step the lost group had reached); and both groups end with bit-identical
parameters. Figures: detection_s (kill to the healthy group's first quorum without the lost one), recovery_s
(kill to the lost group's first step after it healed), steps_lost.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tasks.acceptance.drills import DrillContext
from tasks.acceptance.record import DrillResult
from tasks.launch import registry
from tasks.launch.lighthouse import ReplicaGroupsJob
from training.config import TrainConfig
from training.recovery_record import recovery_events
from training.replica import quorum_events
from training.run_output import RunOutput

NAME = "replica_loss"
JOB = "drill-replica-loss"
HEALTHY, LOST = 0, 1


def _reached(out: RunOutput, step: int, job: ReplicaGroupsJob, timeout_s: float) -> str | None:
    """Wait until `out` recorded `step`; None, or why it never did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out.metric_ranks() and out.last_step() >= step:
            return None
        ended = [g for g, proc in enumerate(job.groups) if proc.poll() is not None]
        if ended:
            return f"replica group {ended[0]} ended before step {step}: {job.log_tail(ended[0])}"
        time.sleep(0.1)
    return f"replica group {LOST} did not reach step {step} in {timeout_s:.0f} s"


def _params(out: RunOutput) -> dict[int, list[tuple[str, str]]]:
    """Every rank's final parameter digests."""
    return {rank: sorted((p.name, p.sha256) for p in record.pieces) for rank, record in out.params().items()}


def run_replica_loss(
    train: TrainConfig, workdir: Path, procs_per_group: int, kill_at_step: int, timeout_s: float
) -> DrillResult:
    """Run the drill on `train` (fault_tolerance.mode=replica_groups) with replica groups on this machine."""
    job = ReplicaGroupsJob.start(train, workdir, procs_per_group, max_restarts=1)
    try:
        healthy, lost = job.output(HEALTHY), job.output(LOST)
        never = _reached(lost, kill_at_step, job, timeout_s)
        if never is not None:
            return DrillResult(NAME, False, message=never, evidence={"workdir": str(workdir)})
        killed_at = lost.last_step()
        t_fail = time.time()
        job.kill_group(LOST, signal.SIGKILL)
        codes = job.wait(timeout_s)
    finally:
        job.stop()
    steps = train.run.steps
    ran = [r.step for r in healthy.metric_records()]
    healthy_restores = [e for e in recovery_events(str(healthy.dir)) if e.time > t_fail]
    lost_events = [e for e in recovery_events(str(lost.dir)) if e.time > t_fail]
    live = [e for e in lost_events if e.rung == "live"]
    other = [e for e in lost_events if e.rung != "live"]
    groups = train.fault_tolerance.replica_groups
    dropped = [q for q in quorum_events(str(healthy.dir)) if q.time > t_fail and q.participants < groups]
    restored = live[0].restored_step if live else None
    first_after = [r.time_unix_s for r in lost.metric_records() if restored is not None and r.step == restored + 1]
    steps_lost = None if restored is None else max(0, killed_at - restored)
    matched = bool(_params(healthy)) and _params(healthy) == _params(lost)
    problems = []
    if codes != [0] * len(codes):
        problems.append(f"the groups' torchrun exit codes were {codes} (0 expected)")
    if ran != list(range(1, steps + 1)):
        problems.append(f"the healthy group's steps were not 1..{steps} once each: {ran}")
    if healthy_restores:
        problems.append(f"the healthy group restored after the kill: {[e.rung for e in healthy_restores]}")
    if not live:
        problems.append("the lost group recorded no live recovery (rung 'live' in recovery.jsonl)")
    if other:
        problems.append(f"the lost group restored from {[e.rung for e in other]}, not only from a peer")
    if steps_lost:
        problems.append(f"{steps_lost} steps lost: killed at step {killed_at}, pulled step {restored}")
    if not matched:
        problems.append("the groups' final parameters differ")
    return DrillResult(
        NAME,
        not problems,
        recovery_s=round(max(first_after) - t_fail, 3) if first_after else None,
        detection_s=round(dropped[0].time - t_fail, 3) if dropped else None,
        steps_lost=steps_lost,
        state_matched=matched,
        message="; ".join(problems) or f"replica group {LOST} healed from group {HEALTHY} at step {restored}",
        evidence={"killed_at_step": killed_at, "restored_step": restored, "exit_codes": codes,
                  "healthy_steps": len(ran), "workdir": str(workdir)},
    )  # fmt: skip


def drill_replica_loss(ctx: DrillContext) -> DrillResult:
    """SIGKILL one replica group mid-training; it heals from a healthy group, which never reloads."""
    base, cluster = ctx.base, ctx.cluster
    if not registry.capabilities(cluster.scheduler).runs_on_this_machine_only:  # the drill starts them here
        return DrillResult(NAME, None, message=f"skipped: replica groups are started by the local launcher only "
                           f"(scheduler {cluster.scheduler}); run the drill with scheduler: local")  # fmt: skip
    if base.parallel.sharding != "ddp" or base.parallel.model_parallel:
        return DrillResult(NAME, None, message="skipped: live recovery needs a data-parallel layout "
                           "(parallel.sharding=ddp, no tensor, pipeline or expert parallelism); model-parallel "
                           "layouts recover through memory_restore")  # fmt: skip
    # The job's ranks split into replica groups: one per node, or two halves of a lone node.
    groups = max(2, cluster.nodes)
    procs = cluster.procs_per_node if cluster.nodes >= 2 else max(1, cluster.procs_per_node // 2)
    train = ctx.train(JOB, fault_tolerance={"mode": "replica_groups", "replica_groups": groups})
    kill_at = max(2, train.run.steps // 3)
    return run_replica_loss(train, ctx.root / JOB, procs, kill_at, ctx.acceptance.job_timeout_s)
