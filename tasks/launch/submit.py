"""Pick the launcher for a scheduler and submit the training job through it."""

from __future__ import annotations

from collections.abc import Mapping

from tasks.cluster import ClusterConfig
from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobStatus, Launcher
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from training.config import TrainConfig


class JobFailed(UserError):
    """The training job failed or was cancelled; retrying the submission would not help."""

    def __init__(self, handle: JobHandle, status: JobStatus) -> None:
        super().__init__(f"job {handle.ref} {status.describe()}", f"read the log: {handle.log_path}")
        self.handle, self.status = handle, status


def launcher_for(scheduler: str, env: Mapping[str, str] | None = None) -> Launcher:
    """The launcher of a scheduler kind; `env` is added to the environment its tools and local processes start
    from (a Kubernetes pod does not start from it)."""
    if scheduler == "local":
        return LocalLauncher(env)
    if scheduler == "ssh":
        from tasks.launch.ssh import SshLauncher

        return SshLauncher(env)
    if scheduler == "slurm":
        return SlurmLauncher(env)
    if scheduler == "kubernetes":
        from tasks.launch.kubernetes import KubernetesLauncher

        return KubernetesLauncher()
    raise UserError(f"cluster.scheduler={scheduler}: unknown", "use local, ssh, slurm or kubernetes")


def submit(
    cluster: ClusterConfig,
    train: TrainConfig,
    name: str,
    image: str | None = None,
    *,
    faults: Mapping[str, str] | None = None,
    supervised: bool = True,
) -> tuple[Launcher, JobHandle]:
    """Submit through the cluster's scheduler (the job gets cluster.env, and `faults` if given); returns the
    launcher and the job handle.

    `supervised`: a local job stops when this process ends (callers that wait for it); False leaves it
    running on its own (`tdeploy submit`). Slurm and Kubernetes jobs always run on their own.
    """
    launcher = launcher_for(cluster.scheduler)
    handle = launcher.submit(cluster, train, name, image, faults=faults, supervised=supervised)
    return launcher, handle
