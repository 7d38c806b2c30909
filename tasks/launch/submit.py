"""Pick the launcher for a scheduler and submit the training job through it."""

from __future__ import annotations

from typing import Any

from tasks.cluster import ClusterConfig
from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobStatus
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from training.config import TrainConfig


class JobFailed(UserError):
    """The training job failed or was cancelled; retrying the submission would not help."""

    def __init__(self, handle: JobHandle, status: JobStatus) -> None:
        super().__init__(f"job {handle.ref} {status.describe()}", f"read the log: {handle.log_path}")
        self.handle, self.status = handle, status


def launcher_for(scheduler: str) -> Any:
    """The launcher of a scheduler kind."""
    if scheduler == "local":
        return LocalLauncher()
    if scheduler == "slurm":
        return SlurmLauncher()
    if scheduler == "kubernetes":
        from tasks.launch.kubernetes import KubernetesLauncher

        return KubernetesLauncher()
    raise UserError(f"cluster.scheduler={scheduler}: unknown", "use local, slurm or kubernetes")


def submit(
    cluster: ClusterConfig,
    train: TrainConfig,
    name: str,
    image: str | None = None,
    env: dict[str, str] | None = None,
    supervised: bool = True,
) -> tuple[Any, JobHandle]:
    """Submit through the cluster's scheduler; returns the launcher and the job handle.

    `supervised`: a local job stops when this process ends (callers that wait for it); False leaves it
    running on its own (`tdeploy submit`). Slurm and Kubernetes jobs always run on their own.
    """
    launcher = launcher_for(cluster.scheduler)
    if cluster.scheduler == "local":
        return launcher, launcher.submit(cluster, train, name, env, supervised=supervised)
    if cluster.scheduler == "slurm":
        if env:
            launcher = SlurmLauncher(env)
        return launcher, launcher.submit(cluster, train, name, image)
    from tasks.launch.kubernetes import render_manifests

    if not image:
        raise UserError(
            "cluster.scheduler=kubernetes needs an image", "build one first (tdeploy build-image) or pass --image"
        )
    return launcher, launcher.submit(render_manifests(cluster, train, name, image), train.run.output_url)
