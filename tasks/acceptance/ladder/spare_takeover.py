"""The spare_takeover drill (rung 2 of the recovery ladder): a node is lost past the first checkpoint and a hot
spare (cluster.spares) takes its place in the same job: no requeue, the same world, the lost agent gone from the
ranks, and training goes on as the uninterrupted run did.

What happened is read from the trainer's records (recovery.jsonl: the "spare" event and the restore's own;
ranks.json: each rank's agent), never from logs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.acceptance.drills import DrillContext, committed_steps
from tasks.acceptance.record import DrillResult
from tasks.acceptance.workspace import first_step_time_after, last_step
from tasks.launch import registry
from training.drill_points import HOLD_MARKER_PREFIX, RELEASE_FILE, paused_ranks
from training.recovery_record import RecoveryEvent, recovery_events
from training.spares import AGENT_KEY
from validation.data_consistency import Sampling, check_data_consistency

NAME = "spare_takeover"
JOB = "drill-spare-takeover"
RESTORE_RUNGS = ("memory", "storage")
MEMORY_EVERY_STEPS = 1


def _skip_reason(ctx: DrillContext) -> str | None:
    """Why the drill cannot run on this cluster (None: it can), with what it needs."""
    cluster = ctx.cluster

    def able(name: str) -> bool:
        caps = registry.capabilities(name)
        return caps.has_hot_spares and caps.can_lose_node

    if not able(cluster.scheduler):
        which = " or ".join(n for n in registry.names() if able(n))
        return f"not drilled on scheduler {cluster.scheduler} (needs hot spares and a node to lose: {which})"
    if cluster.nodes < 2:
        return "needs cluster.nodes >= 2 (a survivor keeps the job while the spare joins)"
    if cluster.spares < 1:
        return "needs cluster.spares >= 1 (a spare host to take the lost one's place)"
    return None


def drill_spare_takeover(ctx: DrillContext) -> DrillResult:
    """SIGKILL every process of the last node past the first checkpoint; a hot spare must join the same job
    (recovery.jsonl rung "spare"), the world stay cluster.world_size without the lost agent, and the losses after
    the restore match the uninterrupted run.

    detection_s: from the kill to the trainer's takeover record (the survivors noticed, the group re-formed with
    the spare and its workers restored); recovery_s: to the first step after the restore; steps_lost: the steps
    trained since the restored state (the restore is the memory or storage rung's, recorded beside it)."""
    why = _skip_reason(ctx)
    if why is not None:
        return DrillResult(NAME, None, message=f"skipped: {why}")
    cluster = ctx.cluster
    # The state comes back by the next rung down: the host-memory copies (rung 3), storage where they fail (rung 4).
    train = ctx.train(JOB, checkpoint={"memory_every_steps": MEMORY_EVERY_STEPS})
    out = Path(train.run.output_url)
    markers = ctx.root / JOB / "hold"
    held_at = ctx.acceptance.save_every_steps + 1  # one step past the first storage checkpoint
    hold = {"step": held_at, "marker_dir": str(markers), "timeout_s": ctx.acceptance.job_timeout_s}
    job = ctx.job(train, JOB, environment=ctx.environment.with_drill_points(hold_after_step=hold))
    job.wait_until(
        lambda: len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) == cluster.world_size,
        f"every rank at step {held_at}", ctx.acceptance.job_timeout_s,
    )  # fmt: skip
    before = job.ranks_record().ranks
    lost = job.kill_node(cluster.nodes - 1)  # the spares' agents come after the nodes' (tasks/launch/spares.py)
    t_fail = time.time()
    (markers / RELEASE_FILE).touch()
    killed_at = last_step(job.output_dir)
    checkpoint = max((s for s in committed_steps(train) if s <= killed_at), default=None)
    outcome = job.wait(ctx.acceptance.job_timeout_s)  # the same job: nothing is resubmitted
    events = [e for e in recovery_events(str(out)) if e.time >= t_fail]
    spare: RecoveryEvent | None = next((e for e in events if e.rung == "spare"), None)
    restore: RecoveryEvent | None = next((e for e in events if e.rung in RESTORE_RUNGS), None)
    ranks = outcome.run.ranks()
    after = [] if ranks is None else ranks.ranks
    world = None if ranks is None else ranks.world_size
    lost_agent = f"{lost['host']}:{lost['agent_pid']}"
    agents_after = sorted({str(r.get(AGENT_KEY)) for r in after})
    requeues = job.launcher.restarts(job.handle)
    problems = _problems(ctx, outcome.ok, outcome.status.describe(), spare, world, lost_agent, agents_after, lost,
                         [r["host"] for r in after], requeues)  # fmt: skip
    resumed_from = after[0]["resumed_from_step"] if after else None
    expected = restore.restored_step if restore is not None else checkpoint
    recovery = None
    data = None
    if outcome.ok and world == cluster.world_size:
        recovery = ctx.recovery(outcome, expected)
        if not recovery.passed:
            problems.append(recovery.message)
        data = check_data_consistency(outcome.output_dir, Sampling.of(train, world))
        if not data.passed:
            problems.append(f"data consistency across the lost node and its spare: {data.message}")
    steps_lost = None if resumed_from is None else killed_at - resumed_from
    t_first = None if resumed_from is None else first_step_time_after(out, resumed_from + 1, t_fail)
    evidence: dict[str, Any] = {
        "output_dir": str(out), "job": job.handle.ref, "lost": lost, "killed_at_step": killed_at,
        "checkpoint_step": checkpoint, "resumed_from_step": resumed_from, "world_after": world,
        "agents_before": sorted({str(r.get(AGENT_KEY)) for r in before}), "agents_after": agents_after,
        "hosts_after": sorted({r["host"] for r in after}),
        "spare_nodes": job.handle.details.get("spare_nodes"), "spare_hosts": job.handle.details.get("spare_hosts"),
        "requeues": requeues,
        "spare_event": None if spare is None else spare.to_json(),
        "restore_event": None if restore is None else restore.to_json(),
        "data_consistency": None if data is None else {"passed": data.passed, "message": data.message},
    }  # fmt: skip
    return DrillResult(
        NAME,
        passed=not problems,
        recovery_s=None if t_first is None else t_first - t_fail,
        detection_s=None if spare is None else spare.time - t_fail,
        steps_lost=steps_lost,
        state_matched=None if recovery is None else recovery.passed,
        message="; ".join(problems),
        evidence=evidence,
    )


def _problems(
    ctx: DrillContext,
    ok: bool,
    status: str,
    spare: RecoveryEvent | None,
    world: int | None,
    lost_agent: str,
    agents_after: list[str],
    lost: dict[str, Any],
    hosts_after: list[str],
    requeues: int | None,
) -> list[str]:
    """What keeps the takeover from counting: the job ended badly, no spare joined, another world, the lost
    agent (or, where hosts differ, its host) still among the ranks."""
    cluster = ctx.cluster
    problems = []
    if not ok:
        problems.append(f"the job {status} (a spare should have kept it going)")
    if spare is None:
        problems.append("no spare took over: recovery.jsonl has no 'spare' event since the kill")
    if world is not None and world != cluster.world_size:
        problems.append(f"the world after the loss is {world} ranks, not cluster.world_size={cluster.world_size}")
    if lost_agent in agents_after:
        problems.append(f"the lost node's agent {lost_agent} is still among the ranks")
    if len(set(hosts_after)) > 1 and lost["host"] in hosts_after:  # acted-out nodes all share one host name
        problems.append(f"the lost host {lost['host']} is still among the ranks")
    if requeues:
        problems.append(f"the scheduler requeued the job {requeues} time(s): the spare should have spared that")
    return problems
