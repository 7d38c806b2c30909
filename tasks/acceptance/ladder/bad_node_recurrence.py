"""The bad_node_recurrence drill: the same host fails in two jobs; it is quarantined and the requeue runs without it.

Two jobs of the drill run through the launch step (tasks/launch/step.py `run`, the pipeline's own path), each held
one step past its first checkpoint (training.drill_points.StepHold) while the drill kills every process of the last
node (its agent and workers at once, as when a host dies), on a cluster without torchrun restarts, so that rung 5
(requeue excluding the failing host) is what acts. The first job has no requeue left: the policy blames the host,
remembers its failure and stops. The second job loses the same host again: its second failure within the window
quarantines it (recovery.quarantine_after_failures=2) and the job is requeued without it, and resumes.

The drill keeps its own node memory (never the deployment's: a drill must not quarantine real hosts). It passes when
both decisions (decisions.jsonl) blamed the host as a lost node, the second quarantined it and excluded it, the
requeued job finished without a rank on that host (ranks.json), and the node memory lists it as quarantined.
Needs a launcher that can lose a node and place a job on named hosts with one to spare (SSH: an inventory of
nodes + 1 hosts); skipped elsewhere.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

from tasks.acceptance.drills import DrillContext
from tasks.acceptance.record import DrillResult
from tasks.errors import UserError
from tasks.launch import registry
from tasks.launch.base import JobHandle, find_job
from tasks.launch.cluster import ClusterConfig
from tasks.launch.step import JobInputs, JobResult, run
from tasks.launch.submit import JobFailed
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.policy import Decision
from tasks.recovery.quarantine import NodeMemory
from tasks.recovery.record import read_decisions
from training.drill_points import HOLD_MARKER_PREFIX, RELEASE_FILE, paused_ranks
from training.run_output import RunOutput

NAME = "bad_node_recurrence"


def _skip_reason(cluster: ClusterConfig) -> str | None:
    """Why the drill cannot run on this cluster (None: it can)."""
    launcher = registry.launcher_class(cluster.scheduler)
    if cluster.nodes < 2 or not launcher.capabilities.can_lose_node:
        able = " or ".join(n for n in registry.names() if registry.capabilities(n).can_lose_node)
        return f"skipped: needs cluster.nodes >= 2 on a launcher that can lose a node ({able})"
    hosts = launcher.hosts(cluster)
    if not hosts or len({h.name for h in hosts[: cluster.nodes]}) < cluster.nodes:
        return (f"skipped: the {cluster.scheduler} launcher does not run each node on a host of its own: no host to "
                "exclude (drilled on the ssh launcher)")  # fmt: skip
    victim = hosts[cluster.nodes - 1].name
    try:
        excluded = launcher.excluding(cluster, [victim])
    except UserError as err:
        return f"skipped: needs a spare host to requeue on without {victim} ({err.message})"
    if excluded == cluster:
        return f"skipped: the {cluster.scheduler} launcher cannot leave {victim} out of a requeue"
    return None


class _Submitted:
    """One drill job run by the launch step in a thread: its outcome once it ends."""

    def __init__(self, inputs: JobInputs, ctx: DrillContext, hold: dict[str, Any]) -> None:
        self.result: JobResult | None = None
        self.error: Exception | None = None
        environment = ctx.environment.with_drill_points(hold_after_step=hold)
        self.thread = threading.Thread(target=self._run, args=(inputs, environment), daemon=True)
        self.thread.start()

    def _run(self, inputs: JobInputs, environment: Any) -> None:  # noqa: ANN401 - a JobEnvironment
        try:
            self.result = run(inputs, environment=environment)
        except Exception as err:  # noqa: BLE001 - the drill judges how the job step ended
            self.error = err


def _strike(ctx: DrillContext, inputs: JobInputs, name: str, node: int) -> tuple[_Submitted, dict[str, Any], float]:
    """Run drill job `name`, wait for every rank to hold past the first checkpoint, kill node `node`, release the
    job; returns the running job step, what was killed, and when."""
    markers = ctx.root / name / "hold"
    hold = {"step": ctx.acceptance.save_every_steps + 1, "marker_dir": str(markers),
            "timeout_s": ctx.acceptance.job_timeout_s}  # fmt: skip
    submitted = _Submitted(inputs, ctx, hold)
    deadline = time.monotonic() + ctx.acceptance.job_timeout_s
    while len(paused_ranks(str(markers), HOLD_MARKER_PREFIX)) < inputs.cluster.world_size:
        if not submitted.thread.is_alive() or time.monotonic() > deadline:
            raise UserError(f"drill job {name} ended or timed out before every rank held", "see its log")
        time.sleep(0.05)
    handle: JobHandle = find_job(inputs.train.run.output_url)
    launcher = registry.launcher_for(handle.scheduler)
    ranks = RunOutput(handle.output_dir).ranks()
    killed = launcher.kill_node(handle, node, ranks.ranks if ranks else [], signal.SIGKILL)
    t_fail = time.time()
    (markers / RELEASE_FILE).touch()  # the survivors go on (and find the peer gone); a requeue does not wait
    submitted.thread.join(ctx.acceptance.job_timeout_s * 2)
    return submitted, killed, t_fail


def drill_bad_node_recurrence(ctx: DrillContext) -> DrillResult:
    """Kill the same host in two jobs; judge that it is quarantined and the requeue runs without it."""
    cluster = ctx.cluster.model_copy(update={"max_restarts": 0, "min_nodes": None})
    skipped = _skip_reason(cluster)
    if skipped is not None:
        return DrillResult(NAME, None, message=skipped)
    launcher = registry.launcher_class(cluster.scheduler)
    node = cluster.nodes - 1
    victim = launcher.hosts(cluster)[node].name
    memory_url = str(Path(ctx.root) / "drill-bad-node" / "nodes")
    recovery = RecoveryConfig(requeues=1, quarantine_after_failures=2)
    decisions: list[Decision] = []
    strikes: list[dict[str, Any]] = []
    outcome: _Submitted | None = None
    t_fail = 0.0
    for attempt, requeues in ((1, 0), (2, 1)):
        name = f"drill-bad-node-{attempt}"
        train = ctx.train(name)
        inputs = JobInputs(
            cluster=cluster, train=train, name=name, image=ctx.image, timeout_s=ctx.acceptance.job_timeout_s,
            recovery=recovery.model_copy(update={"requeues": requeues}), node_memory_url=memory_url,
        )  # fmt: skip
        outcome, killed, t_fail = _strike(ctx, inputs, name, node)
        strikes.append({"job": name, "killed": killed, "ended": "finished" if outcome.result else repr(outcome.error)})
        decisions += read_decisions(train.run.output_url, train.storage)
    assert outcome is not None
    quarantined = NodeMemory(memory_url, recovery).quarantined()
    out = ctx.train("drill-bad-node-2").run.output_url
    ranks = RunOutput(out).ranks()
    hosts_after = sorted({r["host"] for r in ranks.ranks}) if ranks else []
    resumed_from = ranks.ranks[0].get("resumed_from_step") if ranks else None
    held_at = ctx.acceptance.save_every_steps + 1
    first_step_after = next((r.time_unix_s for r in RunOutput(out).metric_records(0)
                             if r.time_unix_s and r.time_unix_s > t_fail), None)  # fmt: skip
    problems = []
    lost = [d for d in decisions if d.cause == "lost_node" and victim in d.blamed_hosts]
    if len(lost) < 2:
        problems.append(f"the policy did not blame {victim} for a lost node twice: "
                        f"{[d.describe() for d in decisions]}")  # fmt: skip
    final = decisions[-1] if decisions else None
    if final is None or victim not in final.quarantined_hosts or final.action != "requeue_excluding" \
            or victim not in final.excluded_hosts:  # fmt: skip
        problems.append(f"the second failure did not quarantine and exclude {victim}: "
                        f"{final.describe() if final else 'no decision'}")  # fmt: skip
    if outcome.result is None:
        problems.append(f"the requeued job did not finish: {outcome.error}")
    if victim in hosts_after:
        problems.append(f"the requeued job still ran a rank on {victim} ({hosts_after})")
    if victim not in quarantined:
        problems.append(f"the node memory does not list {victim} as quarantined ({quarantined})")
    if isinstance(outcome.error, JobFailed) and outcome.error.decision is not None:
        problems.append(f"the launch step stopped: {outcome.error.decision.describe()}")
    return DrillResult(
        NAME, passed=not problems,
        detection_s=None if final is None else max(0.0, final.time_unix_s - t_fail),
        recovery_s=None if first_step_after is None else first_step_after - t_fail,
        steps_lost=None if resumed_from is None else held_at - resumed_from, state_matched=None,
        message="; ".join(problems),
        evidence={"victim": victim, "strikes": strikes, "decisions": [d.model_dump(by_alias=True) for d in decisions],
                  "quarantined": quarantined, "hosts_after": hosts_after, "output_dir": out,
                  "killed_at_step": held_at, "resumed_from_step": resumed_from},
    )  # fmt: skip
