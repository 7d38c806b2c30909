"""Where and how the job runs: scheduler, nodes, processes per node, accelerator."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from tasks.launch.config import KubernetesConfig, SlurmConfig, SshLaunchConfig
from training.config import Problem, StrictModel, raise_problems

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables that decide how the job script's shell, the dynamic loader, Python, Slurm or torchrun start the
# job. The spec may be written by anyone allowed to start a deployment, so these stay with the operator.
RESERVED_ENV = frozenset(
    {"PATH", "IFS", "ENV", "BASH_ENV", "SHELLOPTS", "BASHOPTS", "CDPATH", "PS4", "PROMPT_COMMAND", "HOME"}
    | {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONEXECUTABLE"}
)
RESERVED_ENV_PREFIXES = ("LD_", "SLURM_", "SBATCH_", "SRUN_", "PET_", "TDEPLOY_")


def env_problems(env: dict[str, str], field: str = "env") -> list[Problem]:
    """What is wrong with the names (and NULs in the values) of a job environment; values are never echoed."""
    problems: list[Problem] = []
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            problems.append(
                (
                    (field,),
                    name,
                    f"{name!r} is not an environment variable name; use letters, digits and _, "
                    "not starting with a digit (e.g. NCCL_DEBUG)",
                )
            )
        elif name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
            problems.append(
                (
                    (field,),
                    name,
                    "is reserved: it changes how the shell, the dynamic loader, Python, Slurm or torchrun start "
                    "the job (PATH, IFS, BASH_ENV, LD_*, PYTHONPATH, SLURM_*, PET_*, ...); the operator sets such "
                    "variables on the nodes or in the base image",
                )
            )
        elif "\0" in value:
            problems.append(((field, name), "<value with NUL>", "contains a NUL character, which no variable can hold"))
    return problems


class ClusterConfig(StrictModel):
    """The cluster a deployment runs on."""

    scheduler: Literal["local", "ssh", "slurm", "kubernetes"] = Field(
        default="local",
        description="local: torchrun on this machine; ssh: one torchrun agent per host of nodes.hosts, started "
        "over SSH; slurm: sbatch; kubernetes: PyTorchJob.",
    )
    nodes: int = Field(default=1, ge=1, le=100_000, description="Nodes (local: torchrun agents on this machine).")
    procs_per_node: int = Field(
        ge=1, le=256, description="Training processes per node: GPUs per node, or CPU processes on CPU nodes."
    )
    accelerator: str = Field(default="cpu", min_length=1, description="Accelerator type, e.g. cpu, h100-sxm.")
    max_restarts: int = Field(default=0, ge=0, le=100, description="torchrun elastic restarts after a worker failure.")
    min_nodes: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Elastic: the job goes on with as few as this many nodes when others are lost (torchrun "
        "--nnodes=min_nodes:nodes; each loss costs a restart of max_restarts); None = exactly `nodes`.",
    )
    rdzv_port: int | None = Field(
        default=None, ge=1, le=65535, description="local: rendezvous port on 127.0.0.1; None = a free one."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the training processes, e.g. NCCL_IB_HCA, NCCL_DEBUG (not PATH, LD_*, "
        "PYTHONPATH, SLURM_* and the like: those stay with the operator).",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="scheduler=slurm: sbatch settings.")
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig, description="scheduler=kubernetes: PyTorchJob settings."
    )
    ssh: SshLaunchConfig | None = Field(
        default=None,
        description="scheduler=ssh: the hosts and SSH settings of the agents; None = the spec's nodes section.",
    )

    @model_validator(mode="after")
    def _env_names(self) -> ClusterConfig:
        problems = env_problems(self.env)
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            problems.append((("min_nodes",), self.min_nodes, f"must be <= nodes={self.nodes}; lower it or remove it"))
        if self.min_nodes is not None and self.min_nodes < self.nodes and self.max_restarts == 0:
            problems.append(
                (
                    ("max_restarts",),
                    0,
                    f"min_nodes={self.min_nodes} lets the job go on after losing a node, which takes a restart; "
                    "set max_restarts >= 1",
                )
            )
        raise_problems("ClusterConfig", problems)
        return self

    @property
    def world_size(self) -> int:
        """Training processes in total."""
        return self.nodes * self.procs_per_node
