"""Submit the training job through its scheduler's launcher (from the registry)."""

from __future__ import annotations

from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobStatus, Launcher
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.registry import launcher_for
from tasks.recovery.policy import Decision
from training.config import TrainConfig


class JobFailed(UserError):
    """The training job failed or was cancelled; retrying the submission would not help (the launch step's restart
    policy already requeued what it could: `decision` says why it stopped, where it judged the failure)."""

    def __init__(self, handle: JobHandle, status: JobStatus, decision: Decision | None = None) -> None:
        message = f"job {handle.ref} {status.describe()}"
        if decision is not None:
            message += f"; restart policy: {decision.failure_class} failure ({decision.cause}), {decision.why}"
        fix = decision.fix if decision is not None else None
        super().__init__(message, f"{fix + '; ' if fix else ''}read the log: {handle.log_path}")
        self.handle, self.status, self.decision = handle, status, decision


def submit(
    cluster: ClusterConfig,
    train: TrainConfig,
    name: str,
    image: str | None = None,
    *,
    environment: JobEnvironment | None = None,
    supervised: bool = True,
) -> tuple[Launcher, JobHandle]:
    """Submit through the cluster's scheduler (the job gets cluster.env, and `environment` if given); returns the
    launcher and the job handle.

    `supervised`: a local job stops when this process ends (callers that wait for it); False leaves it
    running on its own (`tdeploy submit`). Slurm and Kubernetes jobs always run on their own.
    """
    launcher = launcher_for(cluster.scheduler)
    handle = launcher.submit(cluster, train, name, image, environment=environment, supervised=supervised)
    return launcher, handle
