"""Where and how the job runs: the `cluster` section (scheduler, nodes, processes per node, accelerator).

`cluster.scheduler` is any scheduler of `tasks.launch.registry`; what a scheduler needs of the rest of the
section its launcher checks (`Launcher.cluster_problems`), so this model names no scheduler itself.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from tasks.launch import registry
from tasks.launch.config import KubernetesConfig, PreemptionConfig, SlurmConfig, SshLaunchConfig
from tasks.launch.network import NetworkConfig, env_problems, network_problems
from training.config import Problem, StrictModel, raise_problems
from training.health_gate import HealthGateConfig


class ClusterConfig(StrictModel):
    """The cluster a deployment runs on."""

    scheduler: str = Field(
        default="local",
        description="local: torchrun on this machine; ssh: one torchrun agent per host of nodes.hosts, started "
        "over SSH; slurm: sbatch; kubernetes: PyTorchJob; or a scheduler registered in tasks.launch.registry.",
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
    spares: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="Hot spares: hosts beyond `nodes` whose torchrun agents wait in the rendezvous (torchrun's "
        "standby list) without taking part; when a node is lost, the survivors restart their workers and the "
        "spare takes its place in the same job, with the same world (no requeue). local: agents on this machine; "
        "ssh: the inventory lists nodes + spares hosts; slurm: nodes + spares nodes allocated; kubernetes: "
        "nodes + spares worker pods in an elastic PyTorchJob of exactly `nodes`. Needs max_restarts >= 1.",
    )
    rdzv_port: int | None = Field(
        default=None, ge=1, le=65535, description="local: rendezvous port on 127.0.0.1; None = a free one."
    )
    mttf_hours: float | None = Field(
        default=None,
        gt=0,
        le=1e7,
        description="Mean time to failure of one node (hours), for the checkpoint interval (Young/Daly, "
        "training/checkpoint/interval.py) until the ledger has observed failures of its own: the job's mean time "
        "between failures is mttf_hours / nodes. None = unknown (checkpoint.save_every_steps: auto then saves "
        "only at the end, as before).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the training processes: NCCL/gloo/torch.distributed/OpenMP tuning variables "
        "on the allow-list, e.g. NCCL_IB_HCA, NCCL_DEBUG (the operator extends it with TDEPLOY_ALLOWED_ENV; PATH, "
        "LD_*, PYTHONPATH, SLURM_* and the like stay with the operator).",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="scheduler=slurm: sbatch settings.")
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig, description="scheduler=kubernetes: PyTorchJob settings."
    )
    ssh: SshLaunchConfig | None = Field(
        default=None,
        description="scheduler=ssh: the hosts and SSH settings of the agents; None = the spec's nodes section.",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of a scheduler registered with a settings model (tasks.launch.registry.register), "
        "checked by that model; the built-in schedulers have their own sections (ssh, slurm, kubernetes).",
    )
    network: NetworkConfig = Field(
        default_factory=NetworkConfig,
        description="The job's network: interface, rendezvous and collective timeouts, NCCL and gloo settings.",
    )
    preemption: PreemptionConfig = Field(
        default_factory=PreemptionConfig,
        description="Preemption: the grace period between the scheduler's signal (SIGTERM, or SIGUSR1 from Slurm) "
        "and its kill, in which the trainer finishes its step, checkpoints and exits 75 (state preempted).",
    )
    health_gate: HealthGateConfig = Field(
        default_factory=HealthGateConfig,
        description="The health gate after placement and before the rendezvous: compute, storage and bandwidth "
        "probes on every node; a node outside the band is left out (training/health_gate.py).",
    )

    @field_validator("scheduler")
    @classmethod
    def _registered(cls, value: str) -> str:
        if registry.find(value) is None:
            raise ValueError(f"must be one of {registry.choices()}")
        return value

    @model_validator(mode="after")
    def _env_names(self) -> ClusterConfig:
        problems = env_problems(self.env) + network_problems(self.network, self.env) + self._settings_problems()
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
        if self.spares and not registry.capabilities(self.scheduler).has_hot_spares:
            able = ", ".join(n for n in registry.names() if registry.capabilities(n).has_hot_spares)
            problems.append((("spares",), self.spares, f"scheduler={self.scheduler} keeps no hot spares; use {able} "
                             "or spares: 0"))  # fmt: skip
        if self.spares and self.max_restarts == 0:
            problems.append(
                (
                    ("max_restarts",),
                    0,
                    f"spares={self.spares}: a spare joins when the survivors restart their workers after a node "
                    "loss; set max_restarts >= 1 or spares: 0",
                )
            )
        raise_problems("ClusterConfig", problems)
        return self

    def _settings_problems(self) -> list[Problem]:
        """cluster.settings checked by the scheduler's settings model (refused where it registered none)."""
        model = registry.scheduler(self.scheduler).settings
        if model is None:
            if not self.settings:
                return []
            return [(("settings",), self.settings, f"scheduler={self.scheduler} takes no settings; remove it")]
        try:
            model.model_validate(self.settings)
        except ValidationError as err:
            return [(("settings", *e["loc"]), e.get("input"), e["msg"]) for e in err.errors()]
        return []

    @property
    def world_size(self) -> int:
        """Training processes in total."""
        return self.nodes * self.procs_per_node
