"""Rung 5 of the recovery ladder: after a job failed, the restart policy's decision and the cluster of its requeue.

The launch step (tasks/launch/step.py `run`) calls `decide_after` for a failed job: it gathers the evidence the job
left (the launcher's status and root cause, the trainer's failure.json, the watchdog's hangs.jsonl, the hosts that
no longer answer, how far training got), asks the policy (tasks/recovery/policy.py), remembers the blamed hosts in
the deployment's node memory, and appends the decision to the run's decisions.jsonl. What each scheduler does to
leave hosts out is its launcher's `excluding` (Slurm --exclude, Kubernetes node anti-affinity, the SSH inventory
less the hosts; a local job has no other host).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobStatus, Launcher
from tasks.launch.cluster import ClusterConfig
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.policy import Decision, FailureEvidence, decide, remember
from tasks.recovery.quarantine import NodeMemory
from tasks.recovery.record import append_decision
from training.config import TrainConfig
from training.failure import FailureFileError, failure_since
from training.health_gate import HEALTH_GATE_EXIT_CODE, read_health_gate
from training.run_output import RunOutput, RunOutputFormatError
from training.storage import is_local
from training.watchdog import hang_records

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Requeue:
    """What the launch step does next: stop (`cluster` None) or submit again on `cluster`."""

    decision: Decision
    cluster: ClusterConfig | None


def last_step(train: TrainConfig) -> int | None:
    """The last step rank 0 recorded in the run's output (None: none yet, or an output this machine cannot read)."""
    if not is_local(train.run.output_url):
        return None
    records = RunOutput(train.run.output_url).metric_records(0)
    return max((r.step for r in records), default=None)


def evidence_of(
    launcher: Launcher,
    handle: JobHandle,
    status: JobStatus,
    train: TrainConfig,
    step_before: int | None,
    requeues_done: int,
) -> FailureEvidence:
    """What the failed job `handle` left, as the policy reads it."""
    try:
        workload = failure_since(train.run.output_url, handle.submitted_unix_s, train.storage)
    except FailureFileError as err:
        log.warning("the job's failure record is not used: %s", err)
        workload = None
    hangs, hung_hosts = [], []
    if is_local(train.run.output_url):
        hangs = [h for h in hang_records(handle.output_dir) if h.time_unix_s >= handle.submitted_unix_s]
        try:
            ranks = RunOutput(handle.output_dir).ranks()
        except RunOutputFormatError as err:
            log.warning("ranks.json is not used: %s", err)
            ranks = None
        hosts = {r.get("rank"): r.get("host") for r in (ranks.ranks if ranks else [])}
        hung_hosts = sorted({hosts[rank] for h in hangs for rank in h.late_ranks if hosts.get(rank)})
    # The gate inside the allocation stopped this job (a gate run before the submission, or one whose job went on
    # without the excluded nodes, is not the cause of this failure).
    stopped_by_gate = status.exit_code == HEALTH_GATE_EXIT_CODE and is_local(train.run.output_url)
    gate = read_health_gate(handle.output_dir, train.storage) if stopped_by_gate else None
    gate_excluded = tuple(gate.excluded) if gate and gate.started_unix_s >= handle.submitted_unix_s else ()
    failure = status.failure
    return FailureEvidence(
        job=handle.ref, reason=status.reason, exit_code=status.exit_code, failed_host=status.host,
        rank_error=failure.error if failure else "", rank_exit_code=failure.exitcode if failure else None,
        rank_host=failure.host if failure else None, unreachable_hosts=tuple(launcher.unreachable_hosts(handle)),
        workload=workload, hangs=tuple(h.describe()[:300] for h in hangs), hung_hosts=tuple(hung_hosts),
        step_before=step_before, step_now=last_step(train), requeues_done=requeues_done, gate_excluded=gate_excluded,
    )  # fmt: skip


def without_hosts(launcher: type[Launcher], cluster: ClusterConfig, hosts: Sequence[str]) -> ClusterConfig | None:
    """`cluster` without `hosts` by the launcher's means; None when the launcher has no hosts to leave out."""
    if not hosts:
        return cluster
    excluded = launcher.excluding(cluster, hosts)
    return None if excluded == cluster else excluded


def _can_leave_out(launcher: type[Launcher], cluster: ClusterConfig, hosts: Sequence[str]) -> bool:
    """Whether the launcher places the job on hosts it can leave out (too few left to requeue on still counts)."""
    try:
        return launcher.excluding(cluster, hosts) != cluster
    except UserError:
        return True


def decide_after(
    launcher: Launcher,
    handle: JobHandle,
    status: JobStatus,
    train: TrainConfig,
    cluster: ClusterConfig,
    recovery: RecoveryConfig,
    memory: NodeMemory | None,
    step_before: int | None,
    requeues_done: int,
) -> Requeue:
    """The policy's decision for the failed job (recorded in decisions.jsonl) and the cluster of its requeue."""
    evidence = evidence_of(launcher, handle, status, train, step_before, requeues_done)
    decision = decide(evidence, recovery)
    launcher_class = type(launcher)
    if decision.blamed_hosts and not _can_leave_out(launcher_class, cluster, decision.blamed_hosts):
        # every node of the job is one machine (local): nothing to leave out, nothing to quarantine
        decision = decision.model_copy(update={
            "excluded_hosts": [], "action": "stop" if decision.action == "stop" else "requeue",
            "why": f"{decision.why}; the {launcher_class.scheduler} launcher has no other host to run on",
        })  # fmt: skip
    elif memory is not None:
        decision = remember(decision, memory)
    next_cluster = None
    if decision.action != "stop":
        try:
            next_cluster = without_hosts(launcher_class, cluster, decision.excluded_hosts) or cluster
        except UserError as err:  # too few hosts left: the requeue cannot run, say why
            decision = decision.model_copy(update={"action": "stop", "requeue": 0,
                                                   "why": f"{decision.why}; but no requeue: {err}"})  # fmt: skip
    append_decision(train.run.output_url, decision, train.storage)
    log.warning("job %s: %s", handle.ref, decision.describe())
    return Requeue(decision, next_cluster)
