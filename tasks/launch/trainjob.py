"""Kubeflow Trainer v2: a TrainJob (trainer.kubeflow.org/v1alpha1) on a ClusterTrainingRuntime, rendered and checked.

The TrainJob carries what the Trainer API has a field for (image, command, env, nodes, processes per node,
resources) and patches the rest onto the runtime's pods through `runtimePatches` (volumes and their mounts, service
account, node selector, tolerations, the excluded nodes' affinity, the grace period, annotations). The runtime's
replicated job `node` runs the trainer; Trainer's torch plugin gives it PET_NNODES, PET_NPROC_PER_NODE,
PET_NODE_RANK and PET_MASTER_ADDR/PORT, which training.preemption's in-process torchrun reads.

Validation is against the CRDs' openAPIV3Schema vendored from a tagged Trainer release (crds/README.md), with
unknown fields refused as the API server's strict field validation (kubectl's default) refuses them.
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tasks.errors import UserError
from tasks.launch.torchrun import rdzv_conf_args

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig

CRD_DIR = Path(__file__).parent / "crds"
CRD_RELEASE = "v2.3.0"
"""The Kubeflow Trainer release whose CRDs are vendored in CRD_DIR (crds/README.md names its commit)."""
GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_PLURAL, RUNTIME_PLURAL = "trainjobs", "clustertrainingruntimes"
NODE_JOB = "node"
"""The runtime's replicated job and container that run the trainer (Trainer's constants.Node)."""
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""JobSet's label on every pod of a JobSet (named as its TrainJob)."""
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
"""The Indexed Job's label on each pod: the node index (node 0 hosts the rendezvous)."""
PATCH_MANAGER = "tdeploy"
_CRD_FILES = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
              "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml"}  # fmt: skip
_RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def render_trainjob(
    cluster: ClusterConfig, image: str, name: str, template: dict[str, Any]
) -> list[dict[str, Any]]:
    """[ClusterTrainingRuntime (cluster.kubernetes.render_runtime), TrainJob] running the pod `template` as the
    PyTorchJob renders it: its trainer container, volumes, affinity, grace period, init containers, annotations."""
    pod_spec = template["spec"]
    container = pod_spec["containers"][0]
    k8s = cluster.kubernetes
    command = list(container["command"])
    if cluster.spares:  # an elastic job of exactly `nodes` among nodes + spares pods; node 0 hosts the c10d store
        command = [word for word in command if not word.startswith("--rdzv-conf=")]
        command = [*command[:4], f"--nnodes={cluster.nodes}:{cluster.nodes}", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
                   *rdzv_conf_args(cluster, backend="c10d"), *command[4:]]  # fmt: skip
    env = copy.deepcopy(container["env"])
    gates = pod_spec.get("initContainers") or []
    if gates:
        # A TrainJob cannot add init containers (runtimePatches only patch the runtime's own): the health gate runs
        # first in the trainer's container, which exits with the gate's code when the node fails.
        gate = gates[0]
        env += [e for e in gate["env"] if e["name"] not in {v["name"] for v in env}]
        script = f"{shlex.join(gate['command'])} && exec {shlex.join(command)}"
        command = ["sh", "-c", script]
    trainer: dict[str, Any] = {
        "image": image,
        "command": command,
        "env": env,
        "numNodes": cluster.nodes + cluster.spares,
        "numProcPerNode": cluster.procs_per_node,
    }
    if "resources" in container:
        trainer["resourcesPerNode"] = copy.deepcopy(container["resources"])
    patch: dict[str, Any] = {
        "volumes": copy.deepcopy(pod_spec["volumes"]),
        "containers": [{"name": NODE_JOB, "volumeMounts": copy.deepcopy(container["volumeMounts"])}],
    }
    for key in ("serviceAccountName", "nodeSelector", "affinity", "tolerations", "terminationGracePeriodSeconds"):
        if key in pod_spec:
            patch[key] = copy.deepcopy(pod_spec[key])
    pod: dict[str, Any] = {"spec": patch}
    if template.get("metadata"):
        pod["metadata"] = copy.deepcopy(template["metadata"])
    labels = {"app.kubernetes.io/managed-by": "tdeploy"}
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {"name": k8s.runtime, "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": NODE_JOB, "template": {"spec": {"template": pod}}}]}}}}],
        },
    }  # fmt: skip
    return [runtime_manifest(cluster, image), job] if k8s.render_runtime else [job]


def runtime_manifest(cluster: ClusterConfig, image: str) -> dict[str, Any]:
    """The ClusterTrainingRuntime `cluster.kubernetes.runtime` as Trainer's torch-distributed one, with the
    PyTorchJob's restart behaviour: a failed container restarts in its pod (OnFailure, the in-memory checkpoint
    tier survives) up to cluster.max_restarts times; then the job fails (no JobSet-wide restart)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": cluster.kubernetes.runtime, "labels": {
            "trainer.kubeflow.org/framework": "torch", "app.kubernetes.io/managed-by": "tdeploy"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {"maxRestarts": 0},
                "replicatedJobs": [{"name": NODE_JOB, "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"backoffLimit": cluster.max_restarts, "template": {"spec": {
                        "restartPolicy": "OnFailure", "containers": [{"name": NODE_JOB, "image": image}]}}},
                }}],
            }},
        },
    }  # fmt: skip


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of the vendored CRD of `kind` (version v1alpha1), made strict: an object schema that
    lists its properties refuses others unless it says x-kubernetes-preserve-unknown-fields."""
    with open(CRD_DIR / _CRD_FILES[kind], encoding="utf-8") as f:
        crd = next(doc for doc in yaml.load_all(f, Loader=yaml.CSafeLoader) if doc)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == VERSION)
    return _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        for value in schema.values():
            _strict(value)
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):  # fmt: skip
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def validate_custom_object(manifest: dict[str, Any]) -> None:
    """Raise UserError unless `manifest` (a TrainJob or ClusterTrainingRuntime) fits its CRD's schema and its
    name is an RFC 1035 label (the CRD's own rule)."""
    import jsonschema

    kind = manifest.get("kind")
    what = f"{kind} {manifest.get('metadata', {}).get('name', '?')!r}"
    if kind not in _CRD_FILES or manifest.get("apiVersion") != f"{GROUP}/{VERSION}":
        raise UserError(f"{what}: apiVersion {manifest.get('apiVersion')!r} kind {kind!r} has no vendored CRD",
                        f"render {GROUP}/{VERSION} TrainJob or ClusterTrainingRuntime")  # fmt: skip
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(crd_schema(kind)).iter_errors(manifest))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top)"
        raise UserError(f"{what} does not fit the Trainer {VERSION} CRD at {where}: {error.message}",
                        "fix the cluster.kubernetes settings (or report a rendering bug)")  # fmt: skip
    name = manifest["metadata"].get("name", "")
    if kind == "TrainJob" and not _RFC1035_LABEL.fullmatch(name):
        raise UserError(f"{what}: the name is not an RFC 1035 label of at most 63 characters",
                        "name the job with lowercase letters, digits and -, starting with a letter")  # fmt: skip
