"""Scheduler settings of the `cluster` section: SSH, Slurm and Kubernetes.

Every string here ends up in a shell script (job.sbatch) or a manifest, and the spec may come from
people who are not the operator (the Prefect UI). So each field is checked against a full-string
pattern here, and the launchers quote what they write as well.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from tasks.hosts import NodeHost, UserName
from training.config import StrictModel

SLURM_TIME = re.compile(
    r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2}"
)
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")
# A long or short option; its value printable ASCII without spaces, quotes, backslash or # (sbatch syntax).
_SBATCH_OPTION_VALUE = re.compile(r"[!$-&(-\[\]-~]+")
_SBATCH_OPTION = re.compile(rf"--?[A-Za-z][A-Za-z0-9-]*(={_SBATCH_OPTION_VALUE.pattern})?")
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


KubernetesNamespace = Annotated[
    str, matching(_DNS_LABEL, "a Kubernetes namespace; use up to 63 lowercase letters, digits and - (e.g. train)")
]
SlurmName = Annotated[str, matching(_SLURM_NAME, "a Slurm name; use letters, digits and _ . + - (e.g. gpu)")]
SlurmNames = Annotated[
    str, matching(_SLURM_NAMES, "a Slurm name or comma-separated names; use letters, digits and _ . + - (gpu,cpu)")
]
_FEATURES = re.compile(r"[A-Za-z0-9_.:&|,*()\[\]!-]+")
_GRES = re.compile(r"[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+){0,2}(,[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+){0,2})*")
# A Slurm host list (node[01-04,07],gpu-1); no `/`, which makes --nodelist read a file instead.
_HOST_LIST = re.compile(
    r"[A-Za-z0-9_.-]+(\[[0-9,-]+\][A-Za-z0-9_.-]*)?(,[A-Za-z0-9_.-]+(\[[0-9,-]+\][A-Za-z0-9_.-]*)?)*"
)
_LICENSES = re.compile(r"[A-Za-z0-9_.@-]+(:[0-9]+)?([,|][A-Za-z0-9_.@-]+(:[0-9]+)?)*")
_BEGIN = re.compile(r"[A-Za-z0-9:+-]+")
_COUNT = re.compile(r"[0-9]{1,6}")
_SIZE = re.compile(r"[0-9]{1,12}[KMGT]?")
_SWITCHES = re.compile(rf"[0-9]{{1,6}}(@({SLURM_TIME.pattern}))?")
# The `#SBATCH` options a spec may add (long names only: sbatch takes abbreviations such as --exp for --export,
# which an exact list refuses), each with the form of its value: None = a flag without a value.
SBATCH_OPTIONS: dict[str, tuple[re.Pattern[str] | None, str]] = {
    "--exclusive": (re.compile(r"user|mcs|topo"), "--exclusive or --exclusive=user|mcs|topo"),
    "--constraint": (_FEATURES, "node features with & | , * [ ] ( ), e.g. --constraint=a100&ib"),
    "--gres": (_GRES, "name[:type][:count] separated by commas, e.g. --gres=gpu:a100:8"),
    "--reservation": (_SLURM_NAMES, "reservation names, e.g. --reservation=maint"),
    "--nodelist": (_HOST_LIST, "a host list without /, e.g. --nodelist=node[01-04],gpu-7"),
    "--exclude": (_HOST_LIST, "a host list without /, e.g. --exclude=node[05-06]"),
    "--switches": (_SWITCHES, "a count with an optional @time, e.g. --switches=1@01:00:00"),
    "--licenses": (_LICENSES, "name[:count] separated by commas, e.g. --licenses=fs_lustre:1"),
    "--wckey": (_SLURM_NAME, "a workload key, e.g. --wckey=llm"),
    "--comment": (_SBATCH_OPTION_VALUE, "text without spaces, quotes, \\ or #, e.g. --comment=ablation-3"),
    "--begin": (_BEGIN, "a time, e.g. --begin=now+1hour or --begin=2030-01-01T08:00:00"),
    "--hint": (re.compile(r"compute_bound|memory_bound|multithread|nomultithread"), "--hint=nomultithread"),
    "--threads-per-core": (_COUNT, "a count, e.g. --threads-per-core=1"),
    "--cores-per-socket": (_COUNT, "a count, e.g. --cores-per-socket=32"),
    "--sockets-per-node": (_COUNT, "a count, e.g. --sockets-per-node=2"),
    "--tmp": (_SIZE, "a size in MB or with K, M, G or T, e.g. --tmp=100G"),
    "--contiguous": (None, "--contiguous"),
    "--spread-job": (None, "--spread-job"),
}
_SBATCH_VALUE_OPTIONAL = frozenset({"--exclusive"})
# Options with a field of their own, or that tdeploy sets from the spec: one place for each setting.
_SBATCH_FROM_FIELDS = {
    "--partition": "cluster.slurm.partition",
    "--account": "cluster.slurm.account",
    "--qos": "cluster.slurm.qos",
    "--nice": "cluster.slurm.nice",
    "--time": "cluster.slurm.time_limit",
    "--mem": "cluster.slurm.mem_per_node_mb",
    "--cpus-per-task": "cluster.slurm.cpus_per_node",
    "--nodes": "cluster.nodes",
    "--gpus-per-node": "cluster.procs_per_node",
    "--ntasks-per-node": "cluster.procs_per_node (one task per node runs torchrun)",
    "--job-name": "the spec's name",
    "--signal": "cluster.preemption",
    "--requeue": "cluster.preemption.enabled",
}
# Options that change who the job runs as, where, with what environment, or where it writes: never from a spec.
_SBATCH_REFUSED = {
    "--export": "sets the job's environment around cluster.env's allow-list (LD_PRELOAD=, BASH_ENV=, PATH=); "
    "set allowed variables in cluster.env instead",
    "--export-file": "reads the job's environment from a file; set allowed variables in cluster.env instead",
    "--get-user-env": "loads a user's login environment into the job; set allowed variables in cluster.env instead",
    "--chdir": "moves the job out of the folder tdeploy runs it in; remove it",
    "--uid": "runs the job as another user; remove it (the job runs as the account that submits it)",
    "--gid": "runs the job as another group; remove it (the job runs as the account that submits it)",
    "--output": "moves the job's log away from run.output_url/slurm-%j.out, where `tdeploy logs` reads it; remove it",
    "--error": "moves the job's errors away from run.output_url/slurm-%j.out, where `tdeploy logs` reads them; "
    "remove it",
    "--input": "feeds the job a file from outside its run folder; remove it",
    "--container": "runs an OCI bundle the spec names; use cluster.slurm.container, which runs the built image",
    "--wrap": "replaces tdeploy's job script; remove it",
}


def _allowed_sbatch_option(value: str) -> str:
    """An sbatch option on the allow-list with a value of its form; ValueError naming the fix otherwise."""
    name, has_value, argument = value.partition("=")
    if not name.startswith("--"):
        raise ValueError(f"{value!r}: short options are not accepted; write the long form, e.g. --constraint=a100")
    if name in _SBATCH_REFUSED:
        raise ValueError(f"{name} is refused: it {_SBATCH_REFUSED[name]}")
    if name in _SBATCH_FROM_FIELDS:
        raise ValueError(f"{name} is set from {_SBATCH_FROM_FIELDS[name]}; set it there and remove {name}")
    if name not in SBATCH_OPTIONS:
        raise ValueError(
            f"{name} is not among the sbatch options a spec may pass ({', '.join(SBATCH_OPTIONS)}); "
            "remove it (other options are the operator's: partition defaults or the cluster's configuration)"
        )
    pattern, form = SBATCH_OPTIONS[name]
    if pattern is None:
        if has_value:
            raise ValueError(f"{name} takes no value; write {form}")
    elif (has_value or name not in _SBATCH_VALUE_OPTIONAL) and not pattern.fullmatch(argument):
        raise ValueError(f"{argument!r} is not a value of {name}; write {form}")
    return value


SbatchOption = Annotated[
    str,
    matching(
        _SBATCH_OPTION,
        "an sbatch option; write --option or --option=value, the value without spaces, quotes, \\, # or "
        "control characters (e.g. --exclusive, --constraint=a100&ib)",
    ),
    AfterValidator(_allowed_sbatch_option),
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
        default_factory=list,
        description="More `#SBATCH` options from an allow-list (SBATCH_OPTIONS: --exclusive, --constraint=, "
        "--gres=, --reservation=, --nodelist=, --exclude=, ...), e.g. --exclusive.",
    )

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time; use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 02:00:00)"
            )
        return value


_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


class Toleration(StrictModel):
    """One pod toleration (Kubernetes `tolerations[]`): lets the pods onto nodes with a matching taint."""

    taint: Annotated[str, matching(_LABEL_KEY, "a taint key such as nvidia.com/gpu")] | None = Field(
        default=None, description="Key of the taint to tolerate (Kubernetes' `key`); None with operator Exists "
        "tolerates every taint.",
    )
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="Equal: key and value match; Exists: "
                                                 "the key alone.")  # fmt: skip
    value: Annotated[str, matching(_LABEL_VALUE, "a taint value of up to 63 letters, digits, - _ and .")] | None = (
        Field(default=None, description="Taint value (operator Equal).")
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; None = every effect."
    )


class KubernetesConfig(StrictModel):
    """Kubernetes settings: Kubeflow Trainer v2 (TrainJob on JobSet, the default) or the v1 PyTorchJob."""

    api: Literal["trainjob", "pytorchjob"] = Field(
        default="trainjob",
        description="trainjob: a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, run by JobSet) that "
        "refers to the ClusterTrainingRuntime `runtime`; pytorchjob: a Kubeflow Training Operator v1 PyTorchJob "
        "(kubeflow.org/v1), for clusters that still run the v1 operator.",
    )
    runtime: Annotated[
        str, matching(_DNS_SUBDOMAIN, "a ClusterTrainingRuntime name; use lowercase letters, digits, - and .")
    ] = Field(
        default="torch-distributed",
        description="api=trainjob: the ClusterTrainingRuntime the TrainJob refers to (runtimeRef); its replicated "
        "job `node` runs the trainer. Kubeflow Trainer installs `torch-distributed`.",
    )
    render_runtime: bool = Field(
        default=False,
        description="api=trainjob: also render the ClusterTrainingRuntime `runtime` (torch, one replicated job "
        "`node`, JobSet restarts = cluster.max_restarts), for clusters that have none; it is cluster-scoped, so "
        "applying it replaces one of that name.",
    )
    node_selector: dict[
        Annotated[str, matching(_LABEL_KEY, "a node label key such as nvidia.com/gpu.product")],
        Annotated[str, matching(_LABEL_VALUE, "a node label value of up to 63 letters, digits, - _ and .")],
    ] = Field(default_factory=dict, description="Node labels the pods require (pod nodeSelector).")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Taints the pods tolerate (pod tolerations)."
    )

    namespace: KubernetesNamespace = Field(default="default", description="Namespace of the job.")
    cpu_per_node: float | None = Field(
        default=None, gt=0, le=65_536, allow_inf_nan=False, description="CPU request and limit per pod."
    )
    memory_per_node_gb: float | None = Field(
        default=None, gt=0, le=1_000_000, allow_inf_nan=False, description="Memory request and limit per pod, in GB."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent",
        description="The pods' imagePullPolicy: IfNotPresent (the default; content-addressed tags never change), "
        "Always, or Never (the image is preloaded on the nodes).",
    )
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
    excluded_nodes: list[
        Annotated[str, matching(_DNS_SUBDOMAIN, "a Kubernetes node name; use lowercase letters, digits, - and .")]
    ] = Field(
        default_factory=list,
        max_length=1000,
        description="Nodes the pods must not run on (node affinity: kubernetes.io/hostname NotIn); a requeue after "
        "a failure adds the failing and the quarantined hosts (tasks/recovery/).",
    )


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
