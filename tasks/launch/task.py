"""Prefect task `submit_job`: submit, stream the job's log into the run log, wait, report."""

from __future__ import annotations

from typing import Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.cluster import ClusterConfig
from tasks.deployment import JobResult
from tasks.errors import UserError, retry_on_transient
from tasks.launch.base import TERMINAL, JobHandle, JobState, JobStatus
from tasks.launch.history import steps_lost
from tasks.launch.submit import JobFailed, submit
from training.config import TrainConfig


class JobPreempted(UserError):
    """The job stopped on its scheduler's preemption signal after checkpointing: neither a crash nor a finished
    run. What follows a finished run (acceptance, export) must not run; resubmitting resumes from the checkpoint."""

    def __init__(self, handle: JobHandle, status: JobStatus) -> None:
        super().__init__(
            f"job {handle.ref} {status.describe()}",
            "submit the deployment again: it resumes from the checkpoint the job wrote when it was preempted",
        )
        self.handle, self.status = handle, status


_UNTIL = {
    "submitted": frozenset(JobState),
    "running": frozenset({JobState.RUNNING}),
    "finished": TERMINAL,
}


@task(name="submit_job", retries=3, retry_delay_seconds=[5, 30, 60], retry_condition_fn=retry_on_transient)
def submit_job(
    cluster: ClusterConfig,
    train: TrainConfig,
    name: str,
    image: str | None = None,
    wait_until: Literal["submitted", "running", "finished"] = "finished",
    timeout_s: float = 6 * 3600,
    faults: dict[str, str] | None = None,
) -> JobResult:
    """Submit the training job and wait until it is submitted, running or finished; a failed or cancelled job
    raises JobFailed, a preempted one JobPreempted (after a warning: its checkpoint is there to resume from)."""
    logger = get_run_logger()
    # A job this task waits for dies with this process; one it only starts must outlive the flow run.
    launcher, handle = submit(cluster, train, name, image, faults=faults, supervised=wait_until == "finished")
    logger.info("submitted %s (output %s)", handle.ref, handle.output_dir)
    status = launcher.wait(handle, _UNTIL[wait_until], timeout_s, on_line=lambda line: logger.info("%s", line))
    stopped = status.state in (JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED)
    lost = steps_lost(train, handle.output_dir) if stopped else None
    create_markdown_artifact(
        key="submit-job",
        markdown=f"# Job `{handle.ref}`\n\n- state: **{status.describe()}**\n- output: `{handle.output_dir}`\n"
        f"- log: `{handle.log_path}`\n" + (f"- {lost.describe()}\n" if lost else ""),
        description=f"training job {handle.ref}",
    )
    if lost is not None:
        logger.warning("job %s %s: %s", handle.ref, status.state.value, lost.describe())
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        raise JobFailed(handle, status)
    if status.state is JobState.PREEMPTED:
        logger.warning("job %s was preempted: %s", handle.ref, status.reason)
        raise JobPreempted(handle, status)
    return JobResult(job=handle.ref, state=status.state.value, output_dir=handle.output_dir, handle=handle.to_json())
