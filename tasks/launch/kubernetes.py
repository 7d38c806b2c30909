"""Kubernetes: a Kubeflow PyTorchJob (plus a ConfigMap with run.json), rendered and checked here.

Rendering and validation run everywhere. Validation deserialises the manifest
into the models that Kubeflow's training SDK generates from the PyTorchJob
OpenAPI schema (nested Kubernetes types included), which rejects missing
required fields and wrong types, and then requires the round trip to give the
manifest back unchanged, which rejects unknown or misplaced fields.

With fault_tolerance.mode=replica_groups the manifests are a torchft lighthouse
(Deployment and Service) and one single-pod PyTorchJob per replica group
(`replica_groups_manifests`); they are rendered and validated, not submitted.

The live path (`KubernetesLauncher`) needs a cluster with the training
operator and a kubeconfig; no such cluster runs on the CI machine, so it is
kept small and separate, and not exercised by the tests.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tasks.errors import TransientError, UserError
from tasks.launch.base import (
    Capabilities,
    JobHandle,
    JobState,
    JobStatus,
    Launcher,
    excluded_host_names,
)
from tasks.launch.environment import JobEnvironment
from tasks.launch.lighthouse import LIGHTHOUSE_BIN, group_config, lighthouse_command
from tasks.launch.torchrun import job_env, preemption_args, rdzv_conf_args
from training.checkpoint import KEY_ENV as CHECKPOINT_KEY_ENV
from training.checkpoint.memory import DEFAULT_MEMORY_DIR
from training.config import TrainConfig, first_problem
from training.health_gate import GATE_NODE_ENV
from training.preemption import PREEMPTED_EXIT_CODE
from training.replica import HOST_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV

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
    """[ConfigMap with run.json, PyTorchJob] for `cluster.nodes` pods of `procs_per_node` ranks each; with
    fault_tolerance.mode=replica_groups, [ConfigMap, lighthouse Deployment and Service, one PyTorchJob per group]
    (replica_groups_manifests).

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
        "volumeMounts": [{"name": "tdeploy-config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    if resources:
        container["resources"] = {"limits": dict(resources), "requests": dict(resources)}
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tdeploy-config", "configMap": {"name": f"{name}-config"}}],
    }
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
                role: {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod_spec}}
                for role, count in replicas.items()
                if count > 0
            },
        },
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "namespace": k8s.namespace},
        "data": {"run.json": train.model_dump_json(indent=2)},
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


def pod_exit_codes(pods: list[dict[str, Any]]) -> dict[str, int]:
    """The exit code of each pod's `pytorch` container that terminated (its last run, if it restarted since)."""
    codes = {}
    for pod in pods:
        for container in pod.get("status", {}).get("containerStatuses") or []:
            if container.get("name") != "pytorch":
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
    codes = pod_exit_codes(pods)
    preempted = sorted(pod for pod, code in codes.items() if code == PREEMPTED_EXIT_CODE)
    if state is JobState.FAILED and preempted:
        others = [f"{pod}: exit {code}" for pod, code in sorted(codes.items()) if code != PREEMPTED_EXIT_CODE]
        reason = (
            f"preempted: pod {', '.join(preempted)} checkpointed and exited {PREEMPTED_EXIT_CODE}; resubmit to resume "
            "from its checkpoint (preemptions.jsonl in the run's output names the step)"
        )
        return JobStatus(
            JobState.PREEMPTED, last["type"], reason + "".join(f"; {o}" for o in others), PREEMPTED_EXIT_CODE
        )
    return JobStatus(state, last["type"], last.get("reason", ""))


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

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """`env` is ignored: a pod starts from its manifest's environment, not this process's."""
        from kubernetes import client, config

        try:
            config.load_config()
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
        """Render and check the manifests, create the ConfigMap and the PyTorchJob.

        The job always runs on its own: `supervised` does not apply.
        """
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
        config_map, job = render_manifests(cluster, train, name, image, environment)
        validate_pytorchjob(job)
        namespace = job["metadata"]["namespace"]
        self.core.create_namespaced_config_map(namespace, config_map)
        self.custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job)
        return JobHandle(
            self.scheduler,
            f"{namespace}/{name}",
            name,
            train.run.output_url,
            "",
            # With hot spares every pod is a worker (an elastic job): worker 0 hosts the rendezvous store.
            details={"namespace": namespace, "log_pod": f"{name}-{'worker' if cluster.spares else 'master'}-0"},
            env=dict(cluster.env),
            extra_env=(environment or JobEnvironment()).variables(),
        )

    def status(self, handle: JobHandle) -> JobStatus:
        """The last condition of the PyTorchJob."""
        namespace, name = handle.job_id.split("/", 1)
        try:
            job = self.custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
        except Exception as err:  # noqa: BLE001
            raise TransientError(f"cannot read PyTorchJob {handle.job_id}: {err}", "retried") from err
        pods: list[dict[str, Any]] = []
        if (job.get("status", {}).get("conditions") or [{}])[-1].get("type") == "Failed":
            try:
                listed = self.core.list_namespaced_pod(
                    namespace, label_selector=f"training.kubeflow.org/job-name={name}"
                )
                pods = [self.core.api_client.sanitize_for_serialization(pod) for pod in listed.items]
            except Exception as err:  # noqa: BLE001
                raise TransientError(f"cannot list the pods of PyTorchJob {handle.job_id}: {err}", "retried") from err
        return job_status(job, pods)

    def queue_seconds(self, handle: JobHandle) -> float | None:
        """From the PyTorchJob's creation to its last pod's start (`kubernetes_queue_seconds`)."""
        namespace, name = handle.job_id.split("/", 1)
        try:
            job = self.custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
            listed = self.core.list_namespaced_pod(namespace, label_selector=f"training.kubeflow.org/job-name={name}")
        except Exception as err:  # noqa: BLE001 - the API's errors are many; a queue time not known is None
            log.warning("queue time of %s not known: %s", handle.job_id, err)
            return None
        pods = [self.core.api_client.sanitize_for_serialization(pod) for pod in listed.items]
        return kubernetes_queue_seconds(job, pods)

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[list[str], int]:
        """Log lines of the master pod (offset counts lines here)."""
        namespace, name = handle.job_id.split("/", 1)
        text = self.core.read_namespaced_pod_log(handle.details.get("log_pod", f"{name}-master-0"), namespace)
        lines = text.splitlines()
        return lines[offset:], len(lines)

    def cancel(self, handle: JobHandle) -> None:
        """Delete the PyTorchJob (its pods go with it)."""
        namespace, name = handle.job_id.split("/", 1)
        self.custom.delete_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
