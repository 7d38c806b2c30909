"""Prefect task `submit_job`: the job step's `run`, streaming the job's log into the run log."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.errors import retry_on_transient
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.launch.environment import JobEnvironment
from tasks.launch.history import StepsLost
from tasks.launch.step import ARTIFACT, JobInputs, JobResult, run
from tasks.recovery.policy import Decision


def publish(handle: JobHandle, status: JobStatus, lost: StepsLost | None, decisions: Sequence[Decision] = ()) -> None:
    """Publish the job's final state, output and log, and the restart policy's decisions with their evidence;
    warn about lost steps and a preemption."""
    logger = get_run_logger()
    create_markdown_artifact(
        key=ARTIFACT,
        markdown=f"# Job `{handle.ref}`\n\n- state: **{status.describe()}**\n- output: `{handle.output_dir}`\n"
        f"- log: `{handle.log_path}`\n" + (f"- {lost.describe()}\n" if lost else "") + decisions_markdown(decisions),
        description=f"training job {handle.ref}",
    )
    for decision in decisions:
        logger.warning("restart policy: %s", decision.describe())
    if lost is not None:
        logger.warning("job %s %s: %s", handle.ref, status.state.value, lost.describe())
    if status.state is JobState.PREEMPTED:
        logger.warning("job %s was preempted: %s", handle.ref, status.reason)


@task(name="submit_job", retries=3, retry_delay_seconds=[5, 30, 60], retry_condition_fn=retry_on_transient)
def submit_job(inputs: JobInputs, environment: JobEnvironment | None = None) -> JobResult:
    """Submit the training job and wait until it is submitted, running or finished; a failed or cancelled job
    raises JobFailed, a preempted one JobPreempted (after a warning: its checkpoint is there to resume from).
    `environment`: a drill's or a test's variables for the job (tasks/launch/environment.py), never a spec's."""
    return run(inputs, publish, on_line=log_line, environment=environment)


def decisions_markdown(decisions: Sequence[Decision]) -> str:
    """The restart policy's decisions (decisions.jsonl) as a table, each with its evidence; "" when there are none."""
    if not decisions:
        return ""
    rows = ["", "## Restart policy", "", "| job | class | cause | action | why | evidence | fix |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in decisions:
        action = d.action + (f" ({', '.join(d.excluded_hosts)})" if d.excluded_hosts else "")
        cells = [d.job, d.failure_class, d.cause, action, d.why, "; ".join(d.evidence)[:300], d.fix]
        rows.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def log_line(line: str) -> None:
    """One line of the job's log (or of its submission) into the task's run log."""
    get_run_logger().info("%s", line)
