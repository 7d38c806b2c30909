"""The replica_loss drill: one replica group loses its workers mid-training (SIGKILL); its torchrun restarts them
and they pull the state from the healthy group (rung "live" in recovery.jsonl), while the healthy group trains on
without reloading.

The job runs through the spec's launcher as a `fault_tolerance.mode: replica_groups` job (the path `tdeploy train`
takes: tasks/launch/replica_supervisor.py locally), each group writing under `<output>/replica-<g>`; the lost
group's ranks are killed through the launcher (`kill_rank`, which reaches their host). Passes when the job
succeeded; the healthy group's steps ran 1..N once each, in order, and it recorded no restore after its start; the
lost group recorded a "live" recovery after the kill and no restore from memory or storage; no step was lost (the
pulled step is at least the step the lost group had reached); and both groups end with bit-identical parameters.
Figures: detection_s (kill to the healthy group's first quorum without the lost one), recovery_s (kill to the lost
group's first step after it healed), steps_lost.

Every rank holds after the kill step (training.drill_points.StepHold, as rank_kill does): the lost group is killed
while it waits there, however fast the steps and however slow the launcher's kill (an SSH round trip), then the
healthy group is released. Restarted workers run without drill points, so the healed group does not hold again.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tasks.acceptance.drills import DrillContext
from tasks.acceptance.record import DrillResult
from tasks.acceptance.workspace import Job
from tasks.errors import UserError
from tasks.launch import registry
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from training.config import TrainConfig
from training.drill_points import RELEASE_FILE
from training.recovery_record import recovery_events
from training.replica import quorum_events
from training.run_output import RunOutput
from training.storage import local_path

NAME = "replica_loss"
JOB = "drill-replica-loss"
HEALTHY, LOST = 0, 1


def _params(out: RunOutput) -> dict[int, list[tuple[str, str]]]:
    """Every rank's final parameter digests."""
    return {rank: sorted((p.name, p.sha256) for p in record.pieces) for rank, record in out.params().items()}


def replica_cluster(cluster: ClusterConfig) -> ClusterConfig:
    """`cluster` as replica groups need it: restarts (a lost group comes back by one), no spares, no elasticity."""
    return cluster.model_copy(update={"max_restarts": max(1, cluster.max_restarts), "spares": 0, "min_nodes": None})


def run_replica_loss(
    cluster: ClusterConfig,
    train: TrainConfig,
    kill_at_step: int,
    timeout_s: float,
    environment: JobEnvironment | None = None,
    image: str | None = None,
) -> DrillResult:
    """Run the drill on `train` (fault_tolerance.mode=replica_groups) through `cluster`'s launcher; the hold's
    markers go beside its output folder (shared by the hosts as the output is)."""
    markers = Path(local_path(train.run.output_url)).parent / "hold"
    hold = {"step": kill_at_step, "marker_dir": str(markers), "timeout_s": timeout_s}
    environment = (environment or JobEnvironment()).with_drill_points(hold_after_step=hold)
    job = Job(replica_cluster(cluster), train, JOB, environment, image, phase=NAME)
    out = RunOutput(job.output_dir)
    healthy, lost = RunOutput(out.dir / f"replica-{HEALTHY}"), RunOutput(out.dir / f"replica-{LOST}")
    try:
        job.wait_until(lambda: bool(lost.metric_ranks()) and lost.last_step() >= kill_at_step,
                       f"replica group {LOST}'s step {kill_at_step}", timeout_s, poll_s=0.05)  # fmt: skip
        killed_at = lost.last_step()
        ranks = lost.ranks()
        if ranks is None:
            raise UserError(f"replica group {LOST} recorded no ranks in {lost.dir}", f"see {job.handle.log_path}")
        t_fail = time.time()
        for rank in ranks.ranks:
            job.launcher.kill_rank(job.handle, rank, signal.SIGKILL)
        markers.mkdir(parents=True, exist_ok=True)
        (markers / RELEASE_FILE).touch()  # the healthy group goes on; the lost one's restart holds no more
        outcome = job.wait(timeout_s)
    except UserError as err:
        if not job.status().state.terminal:
            job.cancel()
        return DrillResult(NAME, False, message=str(err), evidence={"output_dir": str(out.dir)})
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
    if not outcome.ok:
        problems.append(f"the job {outcome.status.describe()}")
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
        evidence={"killed_at_step": killed_at, "restored_step": restored, "job": job.handle.ref,
                  "status": outcome.status.describe(), "healthy_steps": len(ran), "output_dir": str(out.dir)},
    )  # fmt: skip


def drill_replica_loss(ctx: DrillContext) -> DrillResult:
    """SIGKILL one replica group mid-training; it heals from a healthy group, which never reloads."""
    base, cluster = ctx.base, ctx.cluster
    if not registry.capabilities(cluster.scheduler).live_recovery:
        return DrillResult(NAME, None, message=f"skipped: the {cluster.scheduler} launcher does not run replica "
                           "groups (Capabilities.live_recovery); run the drill with a launcher that does")  # fmt: skip
    if base.parallel.sharding != "ddp" or base.parallel.model_parallel:
        return DrillResult(NAME, None, message="skipped: live recovery needs a data-parallel layout "
                           "(parallel.sharding=ddp, no tensor, pipeline or expert parallelism); model-parallel "
                           "layouts recover through memory_restore")  # fmt: skip
    # The job's ranks split into replica groups: one per node, or two halves of a lone node.
    groups = cluster.nodes if cluster.nodes >= 2 else 2
    if cluster.world_size % groups:
        return DrillResult(NAME, None, message=f"skipped: {cluster.world_size} rank(s) do not split into {groups} "
                           "replica groups; give the job at least 2 ranks")  # fmt: skip
    train = ctx.train(JOB, fault_tolerance={"mode": "replica_groups", "replica_groups": groups})
    kill_at = max(2, train.run.steps // 3)
    return run_replica_loss(cluster, train, kill_at, ctx.acceptance.job_timeout_s, ctx.environment, ctx.image)
