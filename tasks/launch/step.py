"""The job step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from tasks.errors import UserError
from tasks.launch import registry
from tasks.launch.base import TERMINAL, JobHandle, JobState, JobStatus
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.history import StepsLost, steps_lost
from tasks.launch.requeue import decide_after, without_hosts
from tasks.launch.submit import JobFailed, submit
from tasks.paths import DeploymentPaths
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.policy import Decision
from tasks.recovery.quarantine import NodeMemory
from tasks.results import StepResult
from training.config import TrainConfig

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
        """The job of `spec` on `train` (data_and_training's), running `image`."""
        return cls(
            cluster=spec.cluster, train=train, name=spec.name, image=image, wait_until=wait_until, detached=detached,
            recovery=spec.recovery, node_memory_url=DeploymentPaths.of(spec).node_memory_url,
        )


class JobResult(StepResult):
    """The submitted training job and the state it was left in."""

    job: str
    state: str
    output_dir: str
    handle: dict[str, Any]

    def summary(self) -> str:
        """The job's reference, state and output folder."""
        return f"`{self.job}` {self.state}; output `{self.output_dir}`"


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
    while True:
        launcher, handle = submit(cluster, inputs.train, inputs.name, inputs.image, environment=environment,
                                  supervised=supervised)  # fmt: skip
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
    stopped = status.state in (JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED)
    lost = steps_lost(inputs.train, handle.output_dir) if stopped else None
    if publish is not None:
        publish(handle, status, lost, decisions)
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        raise JobFailed(handle, status, decisions[-1] if decisions else None)
    if status.state is JobState.PREEMPTED:
        raise JobPreempted(handle, status)
    return JobResult(job=handle.ref, state=status.state.value, output_dir=handle.output_dir, handle=handle.to_json())
