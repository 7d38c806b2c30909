"""Scheduler settings of the `cluster` section: Slurm and Kubernetes."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from training.config import StrictModel

SLURM_TIME = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2})$"
)


class SlurmConfig(StrictModel):
    """sbatch settings; resources per node come from the cluster section."""

    partition: str | None = Field(default=None, description="Partition; None = the cluster's default.")
    account: str | None = Field(default=None, description="Account to charge.")
    qos: str | None = Field(default=None, description="Quality of service (priority class).")
    nice: int | None = Field(default=None, ge=0, description="Lower the job's priority by this much; None = off.")
    time_limit: str = Field(default="01:00:00", description="Wall-clock limit: MM, MM:SS, HH:MM:SS or D-HH:MM:SS.")
    cpus_per_node: int | None = Field(default=None, ge=1, description="CPUs of the one task per node; None = default.")
    mem_per_node_mb: int | None = Field(default=None, ge=1, description="Memory per node in MB; None = default.")
    container: Literal["pyxis", "apptainer"] | None = Field(
        default=None, description="Run the image from the image-build step through pyxis or apptainer; None = bare."
    )
    container_mounts: list[str] = Field(
        default_factory=list, description="Extra SRC:DST mounts into the container (the output folder is mounted)."
    )
    python: str | None = Field(
        default=None, description="Python on the nodes (bare metal); None = this interpreter (a shared venv)."
    )
    rdzv_port: int = Field(default=29500, ge=1, le=65535, description="c10d rendezvous port on the first node.")
    extra_args: list[str] = Field(default_factory=list, description="More `#SBATCH` options, e.g. --exclusive.")

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.match(value):
            raise ValueError(
                f"{value!r} is not a Slurm time; use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 02:00:00)"
            )
        return value


class KubernetesConfig(StrictModel):
    """Kubeflow PyTorchJob settings."""

    namespace: str = Field(default="default", min_length=1, description="Namespace of the job.")
    cpu_per_node: float | None = Field(default=None, gt=0, description="CPU request and limit per pod.")
    memory_per_node_gb: float | None = Field(default=None, gt=0, description="Memory request and limit per pod.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(default="IfNotPresent")
    service_account: str | None = Field(default=None, description="Service account of the pods.")
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name of the GPUs.")
