"""Where and how the job runs: scheduler, nodes, processes per node, accelerator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.launch.config import KubernetesConfig, SlurmConfig
from training.config import StrictModel


class ClusterConfig(StrictModel):
    """The cluster a deployment runs on."""

    scheduler: Literal["local", "slurm", "kubernetes"] = Field(
        default="local", description="local: torchrun on this machine; slurm: sbatch; kubernetes: PyTorchJob."
    )
    nodes: int = Field(default=1, ge=1, description="Nodes (local: torchrun agents on this machine).")
    procs_per_node: int = Field(
        ge=1, description="Training processes per node: GPUs per node, or CPU processes on CPU nodes."
    )
    accelerator: str = Field(default="cpu", min_length=1, description="Accelerator type, e.g. cpu, h100-sxm.")
    max_restarts: int = Field(default=0, ge=0, description="torchrun elastic restarts after a worker failure.")
    rdzv_port: int | None = Field(
        default=None, ge=1, le=65535, description="local: rendezvous port on 127.0.0.1; None = a free one."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment of the training processes, e.g. NCCL_IB_HCA, NCCL_DEBUG."
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="scheduler=slurm: sbatch settings.")
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig, description="scheduler=kubernetes: PyTorchJob settings."
    )

    @property
    def world_size(self) -> int:
        """Training processes in total."""
        return self.nodes * self.procs_per_node
