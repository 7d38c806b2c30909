"""Scheduler settings of the `cluster` section: SSH, Slurm and Kubernetes.

Every string here ends up in a shell script (job.sbatch) or a manifest, and the spec may come from
people who are not the operator (the Prefect UI). So each field is checked against a full-string
pattern here, and the launchers quote what they write as well.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from tasks.nodes.config import NodeHost, UserName
from training.config import StrictModel

SLURM_TIME = re.compile(
    r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2}"
)
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")
# A long or short option; its value printable ASCII without spaces, quotes, backslash or # (sbatch syntax).
_SBATCH_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[!$-&(-\[\]-~]+)?")
_PROGRAM = re.compile(r"[A-Za-z0-9_./+@-]+")
_MOUNT_PATH = r"/[A-Za-z0-9_./+@=-]*"
_MOUNT = re.compile(rf"{_MOUNT_PATH}:{_MOUNT_PATH}(:[A-Za-z+]+)?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_RESOURCE_NAME = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def matching(pattern: re.Pattern[str], what: str, max_length: int | None = None) -> AfterValidator:
    """A validator that refuses any value `pattern` does not match in full (a trailing newline included), or
    longer than `max_length`; the message says what fits."""

    def check(value: str) -> str:
        if (max_length is not None and len(value) > max_length) or not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


SlurmName = Annotated[str, matching(_SLURM_NAME, "a Slurm name; use letters, digits and _ . + - (e.g. gpu)")]
SlurmNames = Annotated[
    str, matching(_SLURM_NAMES, "a Slurm name or comma-separated names; use letters, digits and _ . + - (gpu,cpu)")
]
SbatchOption = Annotated[
    str,
    matching(
        _SBATCH_OPTION,
        "an sbatch option; write --option or --option=value, the value without spaces, quotes, \\, # or "
        "control characters (e.g. --exclusive, --constraint=a100&ib)",
    ),
]
ProgramPath = Annotated[
    str,
    matching(_PROGRAM, "a plain program path; use letters, digits and _ . / + @ - only (e.g. /opt/venv/bin/python)"),
]
ContainerMount = Annotated[
    str,
    matching(
        _MOUNT,
        "a SRC:DST[:FLAGS] mount of absolute paths; paths of letters, digits and _ . / + @ = - "
        "(no spaces, commas or colons), flags of letters and + (e.g. /data:/data:ro)",
    ),
]


class SlurmConfig(StrictModel):
    """sbatch settings; resources per node come from the cluster section."""

    partition: SlurmNames | None = Field(default=None, description="Partition(s); None = the cluster's default.")
    account: SlurmName | None = Field(default=None, description="Account to charge.")
    qos: SlurmName | None = Field(default=None, description="Quality of service (priority class).")
    nice: int | None = Field(
        default=None, ge=0, le=2_147_483_645, description="Lower the job's priority by this much; None = off."
    )
    time_limit: str = Field(default="01:00:00", description="Wall-clock limit: MM, MM:SS, HH:MM:SS or D-HH:MM:SS.")
    cpus_per_node: int | None = Field(
        default=None, ge=1, le=65_536, description="CPUs of the one task per node; None = default."
    )
    mem_per_node_mb: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="Memory per node in MB (up to 1 PB); None = default."
    )
    container: Literal["pyxis", "apptainer"] | None = Field(
        default=None, description="Run the image from the image-build step through pyxis or apptainer; None = bare."
    )
    container_mounts: list[ContainerMount] = Field(
        default_factory=list, description="Extra SRC:DST mounts into the container (the output folder is mounted)."
    )
    python: ProgramPath | None = Field(
        default=None, description="Python on the nodes (bare metal); None = this interpreter (a shared venv)."
    )
    rdzv_port: int = Field(default=29500, ge=1, le=65535, description="c10d rendezvous port on the first node.")
    extra_args: list[SbatchOption] = Field(
        default_factory=list, description="More `#SBATCH` options, e.g. --exclusive."
    )

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time; use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 02:00:00)"
            )
        return value


class KubernetesConfig(StrictModel):
    """Kubeflow PyTorchJob settings."""

    namespace: Annotated[
        str, matching(_DNS_LABEL, "a Kubernetes namespace; use up to 63 lowercase letters, digits and - (e.g. train)")
    ] = Field(default="default", description="Namespace of the job.")
    cpu_per_node: float | None = Field(
        default=None, gt=0, le=65_536, allow_inf_nan=False, description="CPU request and limit per pod."
    )
    memory_per_node_gb: float | None = Field(
        default=None, gt=0, le=1_000_000, allow_inf_nan=False, description="Memory request and limit per pod, in GB."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(default="IfNotPresent")
    service_account: (
        Annotated[
            str,
            matching(_DNS_SUBDOMAIN, "a service account name; use lowercase letters, digits, - and . (e.g. trainer)"),
        ]
        | None
    ) = Field(default=None, description="Service account of the pods.")
    gpu_resource: Annotated[
        str, matching(_RESOURCE_NAME, "a Kubernetes resource name such as nvidia.com/gpu or amd.com/gpu")
    ] = Field(default="nvidia.com/gpu", description="Extended resource name of the GPUs.")


PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
"""The signals the trainer treats as "checkpoint and stop": schedulers' termination and Slurm's warning."""


class PreemptionConfig(StrictModel):
    """What a job does when its scheduler takes the resources back (preemption, eviction, time limit).

    The trainer always checkpoints at the next step boundary on SIGTERM or SIGUSR1 and exits 75 ("requeue me");
    this section says how long the scheduler waits between its signal and the kill, which Slurm turns into
    `--signal=USR1@grace_period_s` and Kubernetes into the pods' `terminationGracePeriodSeconds`.
    """

    enabled: bool = Field(
        default=True,
        description="true: ask the scheduler for the warning signal and a grace period long enough for a save "
        "(Slurm --signal and --requeue, Kubernetes terminationGracePeriodSeconds); false: the schedulers' defaults.",
    )
    grace_period_s: int = Field(
        default=120,
        ge=10,
        le=3600,
        description="Seconds between the scheduler's signal and its kill: time to finish the step and write a "
        "checkpoint (Slurm sends SIGUSR1 this long before the time limit; Kubernetes waits this long after SIGTERM). "
        "Make it at least the step time plus one checkpoint save; 10 to 3600.",
    )

    @field_validator("enabled", mode="before")
    @classmethod
    def _true_or_false(cls, value: object) -> object:
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false; write true (checkpoint on the signal) or false")
        return value


_ABSOLUTE_PATH = re.compile(r"/[A-Za-z0-9_./+@=-]*")
AbsolutePath = Annotated[
    str,
    matching(_ABSOLUTE_PATH, "an absolute path of letters, digits and _ . / + @ = - (e.g. /shared/transformer-deploy)"),
]


class SshLaunchConfig(StrictModel):
    """scheduler=ssh: the hosts that get one torchrun agent each (first = rendezvous host) and how to reach them.

    Taken from the spec's `nodes` section (hosts, ssh_user, ssh_key_path, known_hosts_path, python) when the spec
    does not give it, so the node checks and the job see the same inventory.
    """

    hosts: list[NodeHost] = Field(min_length=1, description="Hosts in node-rank order; the first holds the rendezvous.")
    user: UserName | None = Field(default=None, description="SSH user; None = the SSH default.")
    key_path: AbsolutePath | None = Field(default=None, description="Private key on the controller; None = defaults.")
    known_hosts_path: AbsolutePath | None = Field(
        default=None, description="known_hosts with the hosts' keys (host keys are always checked); None = default."
    )
    python: ProgramPath = Field(default="python3", description="Python the agents and workers run with on the hosts.")
    workdir: AbsolutePath | None = Field(
        default=None,
        description="Folder on every host holding this project (training/, tasks/); None = the controller's own "
        "checkout, which a shared filesystem shows at the same path.",
    )
    connect_timeout_s: int = Field(default=10, ge=1, le=600, description="SSH connection timeout per host.")
    alive_interval_s: int = Field(
        default=5,
        ge=1,
        le=600,
        description="SSH keep-alive probe interval: a host whose link is gone is noticed after 3 missed probes.",
    )
