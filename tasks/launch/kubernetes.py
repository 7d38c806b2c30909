"""Kubernetes: a Kubeflow Trainer v2 TrainJob or a v1 PyTorchJob (plus a ConfigMap with run.json), rendered,
checked and run here.

cluster.kubernetes.api picks the job API: `trainjob` (the default) renders a TrainJob on a ClusterTrainingRuntime
(tasks/launch/trainjob.py), `pytorchjob` the Training Operator's v1 PyTorchJob; both run the same pod (image,
command, environment, volumes, grace period, health gate). `validate_manifests` checks every object: a TrainJob or
runtime against the vendored Trainer v2 CRD schema, a PyTorchJob by deserialising it into the models that
Kubeflow's training SDK generates from its OpenAPI schema and requiring the round trip to give it back unchanged
(unknown or misplaced fields), core objects against the Kubernetes API schemas (kubernetes-validate).

With fault_tolerance.mode=replica_groups (api=pytorchjob) the manifests are a torchft lighthouse (Deployment and
Service) and one single-pod PyTorchJob per replica group (`replica_groups_manifests`); they are rendered and
validated, not submitted.

The live path (`KubernetesLauncher`) creates, reads, deletes and execs through the `kubernetes` client; the tests
run it against a fake API server (tests/integration/launch/test_kubernetes_launcher.py), no real cluster.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from tasks.errors import TransientError, UserError
from tasks.launch.base import (
    Capabilities,
    JobHandle,
    JobState,
    JobStatus,
    Launcher,
    RenderedFile,
    excluded_host_names,
)
from tasks.launch.environment import JobEnvironment
from tasks.launch.lighthouse import LIGHTHOUSE_BIN, group_config, lighthouse_command
from tasks.launch.torchrun import job_env, preemption_args, rdzv_conf_args
from tasks.launch.trainjob import GROUP as TRAINER_GROUP
from tasks.launch.trainjob import VERSION as TRAINER_VERSION
from tasks.launch.trainjob import (
    COMPLETION_INDEX_LABEL,
    CRD_RELEASE,
    JOBSET_NAME_LABEL,
    NODE_JOB,
    RUNTIME_PLURAL,
    TRAINJOB_PLURAL,
    render_trainjob,
    validate_custom_object,
)
from training.config import TrainConfig, first_problem
from training.health_gate import GATE_NODE_ENV
from training.job_env import DEFAULT_MEMORY_DIR, HOST_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from training.preemption import PREEMPTED_EXIT_CODE
from training.signing import KEY_ENV as CHECKPOINT_KEY_ENV

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig

log = logging.getLogger(__name__)

CONFIG_DIR = "/etc/tdeploy"
LIGHTHOUSE_PORT = 29510
"""The torchft lighthouse's port, in its pod and on its Service (fault_tolerance.mode=replica_groups)."""
REPLICA_GROUP_LABEL = "tdeploy/replica-group"
# The Kubernetes Secret (key `key`) whose value reaches every pod as TDEPLOY_CHECKPOINT_KEY, when it exists.
CHECKPOINT_KEY_SECRET = "tdeploy-checkpoint-key"


def gate_init_container(cluster: ClusterConfig, train: TrainConfig, trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The health gate as an init container of every pod: this node's probes (training/health_gate.py) judged
    alone (its storage, the baseline's compute rate), in the trainer's image and mounts; it exits
    HEALTH_GATE_EXIT_CODE when the node fails, so the pod never starts its trainer there."""
    memory = (train.checkpoint.memory_dir or DEFAULT_MEMORY_DIR) if train.checkpoint.memory_tier_on else None
    folders = [f for f in [memory, *cluster.health_gate.storage_paths] if f]
    argv = ["python", "-m", "training.health_gate", "probe", "--name", f"$({GATE_NODE_ENV})", "--alone",
            "--config", cluster.health_gate.model_dump_json().replace("$", "$$")]  # fmt: skip
    for folder in folders:
        argv += ["--storage", folder.replace("$", "$$")]
    return {
        "name": "health-gate",
        "image": trainer["image"],
        "imagePullPolicy": trainer["imagePullPolicy"],
        "command": argv,
        "env": [{"name": GATE_NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "volumeMounts": copy.deepcopy(trainer["volumeMounts"]),
        **({"resources": copy.deepcopy(trainer["resources"])} if "resources" in trainer else {}),
    }


def render_manifests(
    cluster: ClusterConfig,
    train: TrainConfig,
    name: str,
    image: str,
    environment: JobEnvironment | None = None,
) -> list[dict[str, Any]]:
    """The objects of the job, for cluster.kubernetes.api: trainjob, [ConfigMap with run.json, the
    ClusterTrainingRuntime where render_runtime, TrainJob] (tasks/launch/trainjob.py); pytorchjob, [ConfigMap,
    PyTorchJob] for `cluster.nodes` pods of `procs_per_node` ranks each, and with fault_tolerance.mode=replica_groups
    [ConfigMap, lighthouse Deployment and Service, one PyTorchJob per group] (replica_groups_manifests).

    The pods get cluster.env and cluster.network's variables, and `environment`'s (a drill's points, a test
    plugin) where given.
    """
    k8s = cluster.kubernetes
    resources: dict[str, str] = {}
    if cluster.accelerator != "cpu":
        resources[k8s.gpu_resource] = str(cluster.procs_per_node)
    if k8s.cpu_per_node:
        resources["cpu"] = f"{k8s.cpu_per_node:g}"
    if k8s.memory_per_node_gb:
        resources["memory"] = f"{int(k8s.memory_per_node_gb * 1024)}Mi"
    container: dict[str, Any] = {
        "name": "pytorch",
        "image": image,
        "imagePullPolicy": k8s.image_pull_policy,
        # The training operator sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT for torchrun, which
        # training.preemption runs in-process so that a preempted pod exits 75 (torchrun alone would exit 1).
        "command": [
            "python",
            "-m",
            "training.preemption",
            f"--max-restarts={cluster.max_restarts}",
            *rdzv_conf_args(cluster, backend="static"),  # torchrun's default backend, which the operator leaves
            *preemption_args(cluster),  # SIGTERM reaches the workers; torchrun waits the grace period for them
            "-m",
            "training.train",
            "--config",
            f"{CONFIG_DIR}/run.json",
        ],  # fmt: skip
        # Kubernetes expands $(NAME) in env values; $$ keeps a literal $.
        "env": [
            *({"name": k, "value": v.replace("$", "$$")} for k, v in sorted(job_env(cluster, environment).items())),
            # The checkpoint signing key comes from a Kubernetes Secret, never from the spec or the ConfigMap.
            {
                "name": CHECKPOINT_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": CHECKPOINT_KEY_SECRET, "key": "key", "optional": True}},
            },
        ],
        # The container runtime's /dev/shm is 64 MiB: too small for NCCL's shared-memory transport and data workers.
        "volumeMounts": [{"name": "tdeploy-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }  # fmt: skip
    if resources:
        container["resources"] = {"limits": dict(resources), "requests": dict(resources)}
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tdeploy-config", "configMap": {"name": f"{name}-config"}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }  # fmt: skip
    if train.checkpoint.memory_tier_on:
        # The in-memory checkpoint tier's copies live in RAM (tmpfs) for the pod's life: a restarted container
        # finds them, a pod lost with its node loses them (its peers on other nodes keep a copy).
        container["volumeMounts"].append(
            {"name": "tdeploy-memory", "mountPath": train.checkpoint.memory_dir or DEFAULT_MEMORY_DIR}
        )
        pod_spec["volumes"].append({"name": "tdeploy-memory", "emptyDir": {"medium": "Memory"}})
    if cluster.health_gate.on:
        pod_spec["initContainers"] = [gate_init_container(cluster, train, container)]
    if k8s.service_account:
        pod_spec["serviceAccountName"] = k8s.service_account
    if k8s.excluded_nodes:  # the failing and quarantined hosts of a requeue (Launcher.excluding)
        away = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(k8s.excluded_nodes)}
        pod_spec["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [away]}]}}
        }  # fmt: skip
    if cluster.preemption.enabled:  # between the kubelet's SIGTERM and its SIGKILL: the step and a checkpoint
        pod_spec["terminationGracePeriodSeconds"] = cluster.preemption.grace_period_s
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod_spec["tolerations"] = [
            {("key" if field == "taint" else field): value for field, value in t.model_dump(exclude_none=True).items()}
            for t in k8s.tolerations
        ]
    template: dict[str, Any] = {"spec": pod_spec}
    if train.run.metrics_port is not None:  # Prometheus' pod discovery; rank 0's port (one port per local rank)
        template["metadata"] = {"annotations": {"prometheus.io/scrape": "true",
                                                "prometheus.io/port": str(train.run.metrics_port)}}  # fmt: skip
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "namespace": k8s.namespace},
        "data": {"run.json": train.model_dump_json(indent=2)},
    }
    if k8s.api == "trainjob":
        if train.fault_tolerance.mode == "replica_groups":
            raise UserError(
                "fault_tolerance.mode=replica_groups with cluster.kubernetes.api=trainjob: replica groups are "
                "rendered as one PyTorchJob per group (and a lighthouse), not as TrainJobs",
                "set cluster.kubernetes.api: pytorchjob (the Kubeflow Training Operator v1) for replica groups",
            )
        return [config_map, *render_trainjob(cluster, image, name, template)]
    replicas = {"Master": 1, "Worker": cluster.nodes - 1}
    elastic: dict[str, Any] = {}
    if cluster.spares:
        # Hot spares: an elastic job of exactly `nodes` (torchrun --nnodes=N:N, c10d on worker 0) with nodes + spares
        # worker pods; the extra pods' agents stand by in the rendezvous and replace a lost one (tasks/launch/spares).
        replicas = {"Worker": cluster.nodes + cluster.spares}
        # The operator sets PET_RDZV_BACKEND and PET_NNODES from the policy; the keep-alive (SPARE_KEEP_ALIVE) and
        # join timeout go on the command line, which torchrun reads before PET_RDZV_CONF.
        elastic = {"elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": cluster.nodes, "maxReplicas": cluster.nodes,
                                     "maxRestarts": cluster.max_restarts}}  # fmt: skip
        command = [word for word in container["command"] if not word.startswith("--rdzv-conf=")]
        container["command"] = [*command[:4], *rdzv_conf_args(cluster, backend="c10d"), *command[4:]]
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": {"app.kubernetes.io/managed-by": "tdeploy"}},
        "spec": {
            "nprocPerNode": str(cluster.procs_per_node),
            **elastic,
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": cluster.max_restarts},
            "pytorchReplicaSpecs": {
                role: {"replicas": count, "restartPolicy": "OnFailure", "template": template}
                for role, count in replicas.items()
                if count > 0
            },
        },
    }
    if train.fault_tolerance.mode == "replica_groups":
        return [config_map, *replica_groups_manifests(cluster, train, job, config_map)]
    return [config_map, job]


def replica_groups_manifests(
    cluster: ClusterConfig, train: TrainConfig, job: dict[str, Any], config_map: dict[str, Any]
) -> list[dict[str, Any]]:
    """fault_tolerance.mode=replica_groups, rendered: [lighthouse Deployment, its Service, one PyTorchJob per group].

    As on Slurm, each node (here: each pod) runs one replica group: a PyTorchJob of one pod `<name>-replica-<g>`
    whose torchrun has its own rendezvous (--standalone) and restarts (--max-restarts, then the pod's OnFailure
    restart up to the job's backoffLimit), its own config in the ConfigMap (`replica-<g>` output and checkpoint
    folders) and, in its environment, its group index, the lighthouse's Service address, and the pod's IP as the
    address its manager, checkpoint server and store advertise. The lighthouse is a Deployment of one pod (the
    training image's torchft_lighthouse, listening on every interface of its pod) behind a Service. `job` (the
    PyTorchJob render_manifests built) gives each group's pod template; `config_map` gets the groups' configs.
    """
    groups, k8s = train.fault_tolerance.replica_groups, cluster.kubernetes
    name = job["metadata"]["name"]
    if groups != cluster.nodes:
        raise UserError(
            f"fault_tolerance.replica_groups={groups} with cluster.nodes={cluster.nodes}: on Kubernetes each pod runs "
            "one replica group", f"set fault_tolerance.replica_groups to {cluster.nodes}",
        )  # fmt: skip
    lighthouse = f"{name}-lighthouse"
    if len(lighthouse) > 63:  # a Service name is one DNS label
        raise UserError(f"job name {name!r} is too long for its lighthouse Service {lighthouse!r}",
                        "use a job name of at most 52 characters")  # fmt: skip
    labels = {"app.kubernetes.io/managed-by": "tdeploy", "app.kubernetes.io/name": lighthouse}
    pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    address = f"http://{lighthouse}.{k8s.namespace}.svc:{LIGHTHOUSE_PORT:d}"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": lighthouse, "namespace": k8s.namespace, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{
                "name": "lighthouse", "image": job_image(job), "imagePullPolicy": k8s.image_pull_policy,
                "command": lighthouse_command(train, LIGHTHOUSE_PORT, host="0.0.0.0", binary=[LIGHTHOUSE_BIN]),
                "ports": [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT}],
            }]},
        }},
    }  # fmt: skip
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": lighthouse, "namespace": k8s.namespace, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT,
                                                "targetPort": "lighthouse"}]},
    }  # fmt: skip
    template = next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]
    jobs = []
    for group in range(groups):
        config_map["data"][f"run-replica-{group}.json"] = group_config(train, group).model_dump_json(indent=2)
        pod = copy.deepcopy(template)
        container = pod["spec"]["containers"][0]
        container["command"] = [
            "python", "-m", "training.preemption", "--standalone", "--nnodes=1",
            f"--nproc-per-node={cluster.procs_per_node}", f"--max-restarts={cluster.max_restarts}",
            *preemption_args(cluster), "-m", "training.train", "--config", f"{CONFIG_DIR}/run-replica-{group}.json",
        ]  # fmt: skip
        container["env"] += [
            {"name": REPLICA_GROUP_ENV, "value": str(group)},
            {"name": LIGHTHOUSE_ENV, "value": address},
            {"name": HOST_ENV, **pod_ip},
            {"name": "PET_LOCAL_ADDR", **pod_ip},  # torchrun's MASTER_ADDR: the group's store, which peers reach
        ]
        group_job = copy.deepcopy(job)
        group_job["metadata"]["name"] = f"{name}-replica-{group}"
        group_job["metadata"]["labels"] = {**job["metadata"]["labels"], REPLICA_GROUP_LABEL: str(group)}
        group_job["spec"]["pytorchReplicaSpecs"] = {
            "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}
        }
        jobs.append(group_job)
    return [deployment, service, *jobs]


def job_image(job: dict[str, Any]) -> str:
    """The image of a rendered PyTorchJob's pods."""
    return next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]["containers"][0]["image"]


def pod_exit_codes(pods: list[dict[str, Any]], trainer: str = "pytorch") -> dict[str, int]:
    """The exit code of each pod's trainer container (`pytorch` in a PyTorchJob, `node` in a TrainJob) that
    terminated (its last run, if it restarted since)."""
    codes = {}
    for pod in pods:
        for container in pod.get("status", {}).get("containerStatuses") or []:
            if container.get("name") != trainer:
                continue
            for key in ("state", "lastState"):
                terminated = (container.get(key) or {}).get("terminated")
                if terminated and isinstance(terminated.get("exitCode"), int):
                    codes[pod.get("metadata", {}).get("name", "?")] = terminated["exitCode"]
                    break
    return codes


def kubernetes_queue_seconds(job: dict[str, Any], pods: list[dict[str, Any]]) -> float | None:
    """From the PyTorchJob's creation to the last of its pods' start (`status.startTime`: bound to a node and
    acknowledged by its kubelet); None while a pod has not started or there are none."""
    created = job.get("metadata", {}).get("creationTimestamp")
    starts = [pod.get("status", {}).get("startTime") for pod in pods]
    if not created or not starts or not all(starts):
        return None
    begun = max(datetime.fromisoformat(str(t).replace("Z", "+00:00")) for t in starts)
    return max(0.0, (begun - datetime.fromisoformat(str(created).replace("Z", "+00:00"))).total_seconds())


def trainjob_status(job: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
    """A TrainJob's state: its true Complete, Failed or Suspended condition, else RUNNING while a child Job has
    active pods (status.jobsStatus), else PENDING; a failed job whose trainer exited with PREEMPTED_EXIT_CODE is
    PREEMPTED (as `job_status`)."""
    status = job.get("status") or {}
    true = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    for kind, state in (("Failed", JobState.FAILED), ("Complete", JobState.SUCCEEDED), ("Suspended", JobState.PENDING)):
        condition = next((c for c in true if c.get("type") == kind), None)
        if condition is not None:
            reason = condition.get("message") or condition.get("reason", "")
            return _preempted(state, kind, reason, pod_exit_codes(pods, NODE_JOB))
    active = any((j.get("active") or 0) + (j.get("ready") or 0) > 0 for j in status.get("jobsStatus") or [])
    return JobStatus(JobState.RUNNING, "Running", "") if active else JobStatus(JobState.PENDING, "Created", "")


def job_status(job: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
    """A PyTorchJob's state from its last condition; a failed job whose pods' trainer exited with
    PREEMPTED_EXIT_CODE (evicted or drained, checkpointed within terminationGracePeriodSeconds) is PREEMPTED."""
    conditions = job.get("status", {}).get("conditions") or [{"type": "Created", "reason": ""}]
    last = conditions[-1]
    state = {
        "Created": JobState.PENDING,
        "Running": JobState.RUNNING,
        "Restarting": JobState.RUNNING,
        "Succeeded": JobState.SUCCEEDED,
        "Failed": JobState.FAILED,
    }.get(last["type"], JobState.PENDING)
    return _preempted(state, last["type"], last.get("reason", ""), pod_exit_codes(pods))


def _preempted(state: JobState, condition: str, reason: str, codes: dict[str, int]) -> JobStatus:
    """The status; PREEMPTED instead of FAILED when a pod's trainer exited PREEMPTED_EXIT_CODE."""
    preempted = sorted(pod for pod, code in codes.items() if code == PREEMPTED_EXIT_CODE)
    if state is JobState.FAILED and preempted:
        others = [f"{pod}: exit {code}" for pod, code in sorted(codes.items()) if code != PREEMPTED_EXIT_CODE]
        reason = (
            f"preempted: pod {', '.join(preempted)} checkpointed and exited {PREEMPTED_EXIT_CODE}; resubmit to resume "
            "from its checkpoint (preemptions.jsonl in the run's output names the step)"
        )
        return JobStatus(
            JobState.PREEMPTED, condition, reason + "".join(f"; {o}" for o in others), PREEMPTED_EXIT_CODE
        )
    return JobStatus(state, condition, reason)


KUBERNETES_SCHEMA_VERSION = "1.30.0"
"""The Kubernetes API version whose schemas (kubernetes-validate's) the core objects are checked against."""


def validate_manifests(objects: list[dict[str, Any]]) -> None:
    """Raise UserError naming the first object that is invalid and its first problem: a TrainJob or
    ClusterTrainingRuntime against the vendored Trainer v2 CRD schema, a PyTorchJob against the v1 SDK models,
    core objects (ConfigMap, Deployment, Service, ...) against the Kubernetes API schemas (kubernetes-validate)."""
    import kubernetes_validate

    for obj in objects:
        api = str(obj.get("apiVersion", ""))
        if api.startswith(f"{TRAINER_GROUP}/"):
            validate_custom_object(obj)
        elif api == "kubeflow.org/v1" and obj.get("kind") == "PyTorchJob":
            validate_pytorchjob(obj)
        else:
            what = f"{obj.get('kind')} {obj.get('metadata', {}).get('name', '?')!r}"
            try:
                kubernetes_validate.validate(obj, KUBERNETES_SCHEMA_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                where = ".".join(str(p) for p in err.path) or "(top)"
                raise UserError(f"{what} is not a valid Kubernetes object at {where}: {err.message}",
                                "this is a rendering bug; report it") from err  # fmt: skip
            except kubernetes_validate.SchemaNotFoundError as err:
                raise UserError(f"{what}: apiVersion {api!r} has no Kubernetes schema ({err})",
                                "render a core Kubernetes kind") from err  # fmt: skip


class _Payload:
    """What the SDK's deserialiser expects of an HTTP response."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.data = json.dumps(obj)


def validate_pytorchjob(manifest: dict[str, Any]) -> None:
    """Raise UserError unless the manifest is a valid kubeflow.org/v1 PyTorchJob."""
    from kubeflow.training.api_client import ApiClient

    fix = "fix the cluster.kubernetes settings"
    check_round_trip(ApiClient(), manifest, "KubeflowOrgV1PyTorchJob", "PyTorchJob", fix)


def check_round_trip(client: Any, manifest: dict[str, Any], model_name: str, what: str, fix: str) -> None:
    """Raise UserError unless `manifest` deserialises into the API client's model `model_name` (required fields,
    types) and serialises back unchanged (no unknown or misplaced fields); `fix` is said for an invalid one."""
    try:
        model = client.deserialize(_Payload(manifest), model_name)
    except (ValueError, TypeError) as err:
        raise UserError(f"{what} manifest is invalid: {err}", fix) from err
    back = client.sanitize_for_serialization(model)
    if back != manifest:
        raise UserError(
            f"{what} manifest has fields the schema does not know: {first_difference(manifest, back)}",
            "this is a rendering bug; report it",
        )


def first_difference(ours: Any, schema: Any, path: str = "") -> str:
    """The path of the first field of `ours` that `schema` (the object read back through the API models) lacks
    or holds differently; "" when none."""
    if isinstance(ours, dict) and isinstance(schema, dict):
        for key in ours:
            if key not in schema:
                return f"{path}.{key}".lstrip(".")
            found = first_difference(ours[key], schema[key], f"{path}.{key}")
            if found:
                return found
        return ""
    if isinstance(ours, list) and isinstance(schema, list):
        for i, (a, b) in enumerate(zip(ours, schema, strict=False)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return ""
    return "" if ours == schema else f"{path} ({ours!r} != {schema!r})"


class KubernetesLauncher(Launcher):
    """Live submission through the `kubernetes` client (needs a cluster and the Kubeflow training operator)."""

    scheduler = "kubernetes"
    capabilities = Capabilities(
        runs_image=True,
        runs_on_this_machine_only=False,
        needs_shared_output=False,  # the pods write to storage; no filesystem is assumed shared
        delivers_signals=False,
        can_lose_node=False,
        replaces_lost_host=False,
        has_hot_spares=True,  # cluster.spares: standby agents in the rendezvous (tasks/launch/spares.py)
        live_recovery=False,  # replica groups rendered only (replica_groups_manifests), not submitted
    )

    @classmethod
    def excluding(cls, cluster: ClusterConfig, hosts: Sequence[str]) -> ClusterConfig:
        """cluster.kubernetes.excluded_nodes with `hosts` added: the pods get a node affinity that keeps them off
        those nodes (UserError for a name that is not a Kubernetes node name)."""
        names = excluded_host_names(hosts)
        k8s = cluster.kubernetes
        merged = list(dict.fromkeys([*k8s.excluded_nodes, *names]))
        try:  # validated as the spec's own field is: node names are lowercase DNS subdomains
            checked = type(k8s).model_validate({**k8s.model_dump(), "excluded_nodes": merged})
        except ValidationError as err:
            raise UserError(
                f"hosts {names} cannot be excluded on Kubernetes: {first_problem(err)}",
                "Kubernetes node names are lowercase letters, digits, - and . (as `kubectl get nodes` lists them)",
            ) from err
        return cluster.model_copy(update={"kubernetes": checked})

    @classmethod
    def rendered_files(
        cls, cluster: ClusterConfig, train: TrainConfig, name: str, image: str | None
    ) -> list[RenderedFile]:
        """kubernetes/job.yaml: the objects `submit` creates (`render_manifests`), checked by `validate_manifests`;
        the image is UNBUILT-IMAGE where none is given (`tdeploy build-image` names it)."""
        objects = render_manifests(cluster, train, name, image or "UNBUILT-IMAGE")
        validate_manifests(objects)
        kinds = ", ".join(dict.fromkeys(obj["kind"] for obj in objects))
        checked = {
            "trainjob": f"the Trainer {CRD_RELEASE} CRD schemas and kubernetes-validate",
            "pytorchjob": "the v1 PyTorchJob models and kubernetes-validate",
        }[cluster.kubernetes.api]
        return [RenderedFile("kubernetes/job.yaml", yaml.safe_dump_all(objects, sort_keys=False),
                             f"the training job's Kubernetes objects ({kinds})", checked)]  # fmt: skip

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """`env` is ignored: a pod starts from its manifest's environment, not this process's. The cluster is
        KUBECONFIG's (read now: the client reads it once, at its import), else ~/.kube/config, else in-cluster."""
        from kubernetes import client, config

        kubeconfig = os.environ.get("KUBECONFIG")
        try:
            config.load_config(**({"config_file": kubeconfig} if kubeconfig else {}))
        except Exception as err:  # noqa: BLE001 - the client raises several unrelated types here
            raise UserError(
                f"cluster.scheduler=kubernetes: no cluster configured ({err})",
                "set KUBECONFIG or run inside the cluster",
            ) from err
        self.core, self.custom = client.CoreV1Api(), client.CustomObjectsApi()

    def submit(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        name: str,
        image: str | None = None,
        *,
        environment: JobEnvironment | None = None,
        supervised: bool = True,
    ) -> JobHandle:
        """Render and validate the manifests (`render_manifests`), create them: the ConfigMap, the
        ClusterTrainingRuntime where cluster.kubernetes.render_runtime (an existing one of that name is kept), the
        TrainJob or PyTorchJob.

        The job always runs on its own: `supervised` does not apply.
        """
        from kubernetes.client.exceptions import ApiException

        if not image:
            raise UserError(
                "cluster.scheduler=kubernetes needs an image", "build one first (tdeploy build-image) or pass --image"
            )
        if train.fault_tolerance.mode == "replica_groups":  # the spec refuses it here (live_recovery=False)
            raise UserError(
                "fault_tolerance.mode=replica_groups: the Kubernetes launcher renders replica groups "
                "(replica_groups_manifests) but does not submit or watch them yet",
                "run on the local, SSH or Slurm launcher, or set fault_tolerance.mode=none",
            )
        objects = render_manifests(cluster, train, name, image, environment)
        validate_manifests(objects)
        api = JOB_APIS[cluster.kubernetes.api]
        namespace = cluster.kubernetes.namespace
        for obj in objects:
            if obj["kind"] == "ConfigMap":
                self.core.create_namespaced_config_map(namespace, obj)
            elif obj["kind"] == "ClusterTrainingRuntime":
                try:
                    self.custom.create_cluster_custom_object(api.group, api.version, RUNTIME_PLURAL, obj)
                except ApiException as err:
                    if err.status != 409:
                        raise
                    log.warning("ClusterTrainingRuntime %s exists; the TrainJob uses it as it is",
                                obj["metadata"]["name"])  # fmt: skip
            else:
                self.custom.create_namespaced_custom_object(api.group, api.version, namespace, api.plural, obj)
        # With hot spares every PyTorchJob pod is a worker (an elastic job): worker 0 hosts the rendezvous store.
        log_pod = f"{name}-{'worker' if cluster.spares else 'master'}-0"
        return JobHandle(
            self.scheduler,
            f"{namespace}/{name}",
            name,
            train.run.output_url,
            "",
            details={"namespace": namespace, "api": cluster.kubernetes.api, "log_pod": log_pod},
            env=dict(cluster.env),
            extra_env=(environment or JobEnvironment()).variables(),
        )

    def _job(self, handle: JobHandle) -> tuple[JobApi, str, str]:
        """(the api of the handle's job, its namespace, its name); a handle from before api=trainjob is a
        PyTorchJob."""
        namespace, name = handle.job_id.split("/", 1)
        return JOB_APIS[handle.details.get("api", "pytorchjob")], namespace, name

    def _pods(self, handle: JobHandle, selector: str = "") -> list[dict[str, Any]]:
        """The job's pods (as the API's JSON), narrowed by the label `selector` where given."""
        api, namespace, name = self._job(handle)
        labels = ",".join(filter(None, [f"{api.pod_label}={name}", selector]))
        listed = self.core.list_namespaced_pod(namespace, label_selector=labels)
        return [self.core.api_client.sanitize_for_serialization(pod) for pod in listed.items]

    def _read_job(self, handle: JobHandle) -> dict[str, Any]:
        api, namespace, name = self._job(handle)
        return self.custom.get_namespaced_custom_object(api.group, api.version, namespace, api.plural, name)

    def status(self, handle: JobHandle) -> JobStatus:
        """The TrainJob's conditions and child Jobs (`trainjob_status`) or the PyTorchJob's last condition
        (`job_status`); the pods' exit codes tell a preempted job from a failed one."""
        api = self._job(handle)[0]
        try:
            job = self._read_job(handle)
        except Exception as err:  # noqa: BLE001
            raise TransientError(f"cannot read {api.kind} {handle.job_id}: {err}", "retried") from err
        pods: list[dict[str, Any]] = []
        if api.failed(job):
            try:
                pods = self._pods(handle)
            except Exception as err:  # noqa: BLE001
                raise TransientError(f"cannot list the pods of {api.kind} {handle.job_id}: {err}", "retried") from err
        return api.status(job, pods)

    def queue_seconds(self, handle: JobHandle) -> float | None:
        """From the job's creation to its last pod's start (`kubernetes_queue_seconds`)."""
        try:
            job, pods = self._read_job(handle), self._pods(handle)
        except Exception as err:  # noqa: BLE001 - the API's errors are many; a queue time not known is None
            log.warning("queue time of %s not known: %s", handle.job_id, err)
            return None
        return kubernetes_queue_seconds(job, pods)

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[list[str], int]:
        """Log lines of node 0's trainer (offset counts lines here): the PyTorchJob's master (worker 0 with spares)
        or the TrainJob's pod of completion index 0 (the newest, when the Job replaced it); none before it exists."""
        api, namespace, name = self._job(handle)
        if api.kind == "PyTorchJob":
            pod = handle.details.get("log_pod", f"{name}-master-0")
        else:
            pods = self._pods(handle, f"{COMPLETION_INDEX_LABEL}=0")
            if not pods:
                return [], offset
            pod = max(pods, key=lambda p: str(p["metadata"].get("creationTimestamp", "")))["metadata"]["name"]
        text = self.core.read_namespaced_pod_log(pod, namespace, container=api.trainer)
        lines = text.splitlines()
        return lines[offset:], len(lines)

    def cancel(self, handle: JobHandle) -> None:
        """Delete the TrainJob or PyTorchJob (its JobSet or pods go with it: owner references)."""
        api, namespace, name = self._job(handle)
        self.custom.delete_namespaced_custom_object(api.group, api.version, namespace, api.plural, name)

    def kill_rank(self, handle: JobHandle, rank: Mapping[str, Any], sig: int) -> None:
        """`sig` to the rank's process through `kill` in its pod's trainer container (the pods/exec API); the pod is
        the one of the job whose hostname (as ranks.json records it) or name is rank['host']."""
        from kubernetes.stream import stream

        api, namespace, _ = self._job(handle)
        pods = self._pods(handle)
        pod = next((p for p in pods if rank["host"] in {p["metadata"]["name"], p.get("spec", {}).get("hostname")}),
                   None)  # fmt: skip
        if pod is None:
            raise UserError(
                f"job {handle.ref}: no pod of {api.kind} {handle.job_id} is host {rank['host']!r} of rank "
                f"{rank['rank']}", "kill a rank of a running job (ranks.json names the pods' hostnames)",
            )  # fmt: skip
        argv = ["kill", f"-{int(sig)}", str(int(rank["pid"]))]
        session = stream(self.core.connect_get_namespaced_pod_exec, pod["metadata"]["name"], namespace,
                         container=api.trainer, command=argv, stdout=True, stderr=True, stdin=False, tty=False,
                         _preload_content=False)  # fmt: skip
        session.run_forever(timeout=60)
        code, said = session.returncode, session.read_stderr()
        session.close()
        if code != 0:
            raise UserError(
                f"job {handle.ref}: {shlex.join(argv)} in pod {pod['metadata']['name']} exited {code}: {said.strip()}",
                "the rank's process may have ended already; read ranks.json again",
            )


@dataclass(frozen=True)
class JobApi:
    """Where one Kubernetes job API keeps its jobs and pods, and how it reports them."""

    kind: str
    group: str
    version: str
    plural: str
    pod_label: str
    """The label whose value is the job's name on each of its pods."""
    trainer: str
    """The trainer's container."""
    status: Callable[[dict[str, Any], list[dict[str, Any]]], JobStatus]

    def failed(self, job: dict[str, Any]) -> bool:
        """Whether the job reports failure (then its pods' exit codes tell whether it was preempted)."""
        conditions = job.get("status", {}).get("conditions") or [{}]
        if self.kind == "PyTorchJob":
            return conditions[-1].get("type") == "Failed"
        return any(c.get("type") == "Failed" and c.get("status") == "True" for c in conditions)


JOB_APIS = {
    "trainjob": JobApi("TrainJob", TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL, JOBSET_NAME_LABEL, NODE_JOB,
                       trainjob_status),
    "pytorchjob": JobApi("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", "training.kubeflow.org/job-name",
                         "pytorch", job_status),
}  # fmt: skip
