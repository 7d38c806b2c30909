"""The job step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from tasks.errors import UserError
from tasks.launch import registry
from tasks.launch.base import TERMINAL, JobHandle, JobState, JobStatus, Launcher
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.goodput import job_goodput
from tasks.launch.health_gate import run_health_gate
from tasks.launch.history import StepsLost, steps_lost
from tasks.launch.requeue import decide_after, without_hosts
from tasks.launch.submit import JobFailed, submit
from tasks.paths import DeploymentPaths
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.policy import Decision
from tasks.recovery.exposure import JobExposure, failure_rate, read_exposures, record_exposure
from tasks.recovery.quarantine import NodeMemory
from tasks.results import Figure, StepResult
from training.config import TrainConfig
from training.preemption import read_records as preemption_records
from training.recovery_record import recovery_events
from training.storage import is_local
from validation.checkpoint_interval import recheck_run
from validation.goodput import GoodputField

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

TITLE = "job submission"
ARTIFACT = "submit-job"

WaitUntil = Literal["submitted", "running", "finished"]
_UNTIL = {
    "submitted": frozenset(JobState),
    "running": frozenset({JobState.RUNNING}),
    "finished": TERMINAL,
}


class JobPreempted(UserError):
    """The job stopped on its scheduler's preemption signal after checkpointing: neither a crash nor a finished
    run. What follows a finished run (acceptance, export) must not run; resubmitting resumes from the checkpoint."""

    def __init__(self, handle: JobHandle, status: JobStatus) -> None:
        super().__init__(
            f"job {handle.ref} {status.describe()}",
            "submit the deployment again: it resumes from the checkpoint the job wrote when it was preempted",
        )
        self.handle, self.status = handle, status


class JobInputs(BaseModel):
    """What the job step reads: the cluster, the training config (on the data step's dataset), the deployment's
    name, the image to run and how long to wait."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cluster: ClusterConfig
    train: TrainConfig
    name: str
    image: str | None = None
    """The image reference the job runs (None: the nodes' own environment)."""
    wait_until: WaitUntil = "finished"
    timeout_s: float = 6 * 3600
    """How long to wait for `wait_until` before failing (a detached job is waited for without a limit)."""
    detached: bool = False
    """The job runs on its own: stopping the caller, also while it waits, leaves the job running and waiting has no
    time limit (`tdeploy submit`; `tdeploy cancel` stops the job). Otherwise a job waited for until it finishes
    stops with the caller."""
    recovery: RecoveryConfig = RecoveryConfig()
    """The restart policy's limits: requeues after an infrastructure failure, the node quarantine."""
    node_memory_url: str | None = None
    """The deployment's node memory (tasks/recovery/quarantine.py; None: failures are not remembered and no host is
    quarantined)."""
    gate_baseline_url: str | None = None
    """The deployment's health-gate baseline in the ledger (tasks/launch/health_gate.py; None: none kept)."""
    exposure_url: str | None = None
    """Where a finished job's node-hours and failures go, the deployment's observed failure rate
    (tasks/recovery/exposure.py; None: not recorded)."""

    @classmethod
    def of(
        cls,
        spec: DeploymentSpec,
        train: TrainConfig,
        image: str | None = None,
        wait_until: WaitUntil = "finished",
        *,
        detached: bool = False,
    ) -> JobInputs:
        """The job of `spec` on `train` (data_and_training's), running `image`; checkpoint.mtbf_s, unless the
        spec sets it, from the deployment's observed failures, else cluster.mttf_hours (save_every_steps=auto)."""
        paths = DeploymentPaths.of(spec)
        if train.checkpoint.mtbf_s is None:
            rate = failure_rate(read_exposures(paths.exposure_url, train.storage), spec.cluster.nodes,
                                spec.cluster.mttf_hours)  # fmt: skip
            checkpoint = train.checkpoint.model_copy(update={"mtbf_s": rate.mtbf_s})
            train = train.model_copy(update={"checkpoint": checkpoint})
        return cls(
            cluster=spec.cluster, train=train, name=spec.name, image=image, wait_until=wait_until, detached=detached,
            recovery=spec.recovery, node_memory_url=paths.node_memory_url, exposure_url=paths.exposure_url,
            gate_baseline_url=paths.health_gate_baseline_url,
        )  # fmt: skip


class JobResult(StepResult):
    """The submitted training job and the state it was left in."""

    job: str
    state: str
    output_dir: str
    handle: dict[str, Any]
    interval: str | None = None
    """The checkpoint interval re-checked from the run's measured stall (validation/checkpoint_interval.py)."""
    goodput: GoodputField | None = None
    """The job's allocation split into productive time and badput (None: its records do not give it)."""

    def figures(self) -> dict[str, Figure]:
        """The job's reference, state and output folder, and its goodput (share, allocation and productive
        seconds) where its records give it."""
        goodput = self.goodput
        timing = {} if goodput is None else {"goodput_share": goodput.goodput, "allocation_s": goodput.allocation_s,
                                             "productive_s": goodput.productive_s}  # fmt: skip
        return {"job": self.job, "state": self.state, "output_dir": self.output_dir, **timing}

    def note(self) -> str:
        """The checkpoint interval's re-check, in words."""
        return self.interval or ""

    def summary(self) -> str:
        """The job's reference, state and output folder, its goodput and the checkpoint interval's re-check."""
        line = self.goodput.describe() if self.goodput else None
        extra = "".join(f"; {part}" for part in (line, self.interval) if part)
        return f"`{self.job}` {self.state}; output `{self.output_dir}`" + extra


def run(
    inputs: JobInputs,
    publish: Callable[[JobHandle, JobStatus, StepsLost | None, list[Decision]], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    environment: JobEnvironment | None = None,
) -> JobResult:
    """Submit the training job and wait until it is submitted, running or finished; hand the final state and the
    restart policy's decisions to `publish`; a failed or cancelled job raises JobFailed (with the policy's decision),
    a preempted one JobPreempted (its checkpoint is there to resume from).

    Rung 5 of the recovery ladder: a job waited for until it ends that fails is judged by the restart policy
    (tasks/launch/requeue.py); an infrastructure failure that made progress is submitted again, without the failing
    and the quarantined hosts, up to recovery.requeues times; a workload error is never retried. Quarantined hosts
    are left out of the first submission too."""
    # A job this step waits for dies with this process; one it only starts, or a detached one, must outlive it.
    supervised = inputs.wait_until == "finished" and not inputs.detached
    memory = None if inputs.node_memory_url is None else NodeMemory(inputs.node_memory_url, inputs.recovery,
                                                                      inputs.train.storage)  # fmt: skip
    cluster = inputs.cluster
    quarantined = memory.quarantined() if memory is not None else []
    excluded = without_hosts(registry.launcher_class(cluster.scheduler), cluster, quarantined)
    if excluded is None:  # the launcher has no hosts to leave out (local): nothing is excluded
        quarantined = []
    cluster = excluded or cluster
    decisions: list[Decision] = []
    step_before: int | None = None
    submitted = time.time()
    first: tuple[Launcher, JobHandle] | None = None  # whose queue time counts: later requeues' is recovery
    while True:
        gate = run_health_gate(registry.launcher_for(cluster.scheduler), cluster, inputs.train, memory,
                               baseline_url=inputs.gate_baseline_url)  # fmt: skip
        if on_line is not None and gate.record is not None:
            on_line(gate.record.describe())
        cluster = gate.cluster
        launcher, handle = submit(cluster, inputs.train, inputs.name, inputs.image, environment=environment,
                                  supervised=supervised)  # fmt: skip
        first = first or (launcher, handle)
        if on_line is not None:
            on_line(f"submitted {handle.ref} (output {handle.output_dir})"
                    + (f" without quarantined host(s) {', '.join(quarantined)}" if quarantined else ""))  # fmt: skip
        timeout_s = None if inputs.detached else inputs.timeout_s
        status = launcher.wait(handle, _UNTIL[inputs.wait_until], timeout_s, on_line=on_line)
        if status.state is not JobState.FAILED or inputs.wait_until != "finished":
            break
        requeue = decide_after(launcher, handle, status, inputs.train, cluster, inputs.recovery, memory,
                               step_before, len(decisions))  # fmt: skip
        decisions.append(requeue.decision)
        if on_line is not None:
            on_line(f"restart policy: {requeue.decision.describe()}")
        if requeue.cluster is None:
            break
        cluster, step_before = requeue.cluster, requeue.decision.step_now
    if inputs.exposure_url is not None and supervised and status.state in TERMINAL:
        _record_exposure(inputs, handle, cluster.nodes, submitted, len(decisions))
    stopped = status.state in (JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED)
    lost = steps_lost(inputs.train, handle.output_dir) if stopped else None
    if publish is not None:
        publish(handle, status, lost, decisions)
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        raise JobFailed(handle, status, decisions[-1] if decisions else None)
    if status.state is JobState.PREEMPTED:
        raise JobPreempted(handle, status)
    interval = None
    if status.state is JobState.SUCCEEDED and is_local(handle.output_dir):
        ck = inputs.train.checkpoint
        interval = recheck_run(handle.output_dir, ck.save_every_steps, ck.mtbf_s).describe()
    figures = None
    if first is not None and status.state is JobState.SUCCEEDED:
        figures = job_goodput(*first, submitted)
    return JobResult(job=handle.ref, state=status.state.value, output_dir=handle.output_dir, handle=handle.to_json(),
                     interval=interval, goodput=figures)  # fmt: skip


def _record_exposure(inputs: JobInputs, handle: JobHandle, nodes: int, submitted: float, requeues: int) -> None:
    """The ended job's node-hours and failures (its trainer's restarts after a failure and the policy's requeues)
    in the deployment's exposure folder: the observed failure rate of later jobs' checkpoint interval."""
    assert inputs.exposure_url is not None
    storage = inputs.train.storage
    starts = recovery_events(handle.output_dir, storage)
    preempted = len(preemption_records(handle.output_dir, storage))
    failures = max(len(starts) - 1 - preempted, requeues)  # a requeue's job restarts the trainer too
    ended = time.time()
    record_exposure(inputs.exposure_url, JobExposure(job=handle.ref, nodes=nodes, wall_s=ended - submitted,
                                                     failures=failures, ended_unix_s=ended), storage)
