"""Deployable serving manifests: a Kubernetes Deployment + Service and a Slurm batch script for the model's server.

Both start the server the serving check starts, with the same flags (one function spells them): vLLM's
OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) for a language model and, with the
export's architecture, a vision-language one (`--model-impl`, `--limit-mm-per-prompt`); for an image classifier
(model.kind vit) the classifier server tasks/serve/classifier_server.py, which vLLM's image runs (it has
transformers, Pillow, starlette and uvicorn). Every server listens on all interfaces of serve.port, with /health
for probes and /metrics for Prometheus (scrape job tdeploy-serving: deployments/monitoring/alerts.yml; the
classifier keeps vLLM's metric names). They also pass finer request-latency histogram buckets than vLLM's
defaults, whose first bound (0.3 s) lies above the guide's 150 ms P99 target.

The classifier server is one standalone file that no image ships, so it travels inside what is deployed: in a
ConfigMap mounted read-only into the pod (applied with the Deployment, its digest in the pod template's
annotations so that a changed program rolls the pods), and in the Slurm script as a quoted here-document that
python reads from its standard input. Nothing has to be built, pushed or copied beside the manifests; the
classifier server runs on CPU, so its pods ask for no GPU.

Kubernetes reads the model folder from a PersistentVolumeClaim (`pvc://<claim>/<path>`, as KServe spells a
storage URI), mounted read-only: a model is a few to hundreds of GiB, and a volume that the platform already
backs up and shares beats copying it into every pod at start. Slurm serves a folder on the cluster's shared
filesystem in place. Every value that reaches a manifest or the script is validated here or by the spec, and
quoted for the shell where it is used.
"""

from __future__ import annotations

import hashlib
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from tasks.errors import UserError
from tasks.launch.kubernetes import check_round_trip, validate_manifests
from tasks.names import NAME_PATTERN
from tasks.serve.classifier import SERVER_PROGRAM, classifier_args
from tasks.serve.config import ServeConfig, serving_image
from tasks.serve.server import (  # noqa: F401 - REQUEST_LATENCY_BUCKETS_S: the monitoring tests read it here
    ALL_INTERFACES,
    KIND_ARCHITECTURES,
    REQUEST_LATENCY_BUCKETS_S,
    SERVER_ENV,
    SERVER_MODULE,
    server_args,
    server_env_vars,
)

MODEL_MOUNT = "/model"
GPU_RESOURCE = "nvidia.com/gpu"
K8S_FILE = "serving-k8s.yaml"
SLURM_FILE = "serving.sbatch"
PROBE_PERIOD_S = 10
MEMORY_HEADROOM = 1.2
"""The serving plan's memory estimate times this is a pod's memory request and limit (the estimate's error and the
server's allocator, a limit being a kill)."""
ModelKind = Literal["lm", "vit", "vlm"]
PROGRAM_MOUNT = "/opt/tdeploy"
"""Where the classifier server's ConfigMap is mounted in its pod."""
PROGRAM_DIGEST_ANNOTATION = "tdeploy/classifier-server-sha256"
_HEREDOC_END = "TDEPLOY_CLASSIFIER_SERVER"
# A Service name is a DNS-1035 label: it starts with a letter and ends with a letter or digit.
_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# A claim name is a DNS-1123 subdomain; a path in it is plain relative components (no "..", no shell or $()).
_CLAIM = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class PodResources:
    """What one server pod requests and is limited to (requests = limits: the Guaranteed QoS class)."""

    cpu: float
    """CPU cores."""
    memory_bytes: float

    @classmethod
    def of(cls, serve: ServeConfig, estimate_bytes: float | None = None) -> PodResources | None:
        """serve.cpu_per_replica and serve.memory_per_replica_gb, else `estimate_bytes` (the serving plan's) with
        MEMORY_HEADROOM; None when neither gives the memory."""
        if serve.memory_per_replica_gb is not None:
            return cls(serve.cpu_per_replica, serve.memory_per_replica_gb * 2**30)  # GiB, as cluster.kubernetes's
        if estimate_bytes is None:
            return None
        return cls(serve.cpu_per_replica, estimate_bytes * MEMORY_HEADROOM)

    def quantities(self) -> dict[str, str]:
        """As Kubernetes quantities: cpu in millicores, memory in whole MiB (rounded up)."""
        return {"cpu": f"{math.ceil(self.cpu * 1000):d}m", "memory": f"{math.ceil(self.memory_bytes / 2**20):d}Mi"}


def render_kubernetes(
    serve: ServeConfig,
    name: str,
    model_uri: str,
    image: str | None = None,
    *,
    accelerator: str,
    resources: PodResources | None = None,
    kind: ModelKind = "lm",
) -> list[dict[str, Any]]:
    """[Deployment, Service] of vLLM's server for the model at `model_uri` (pvc://<claim>/<path>), in
    serve.namespace; for model.kind vit [ConfigMap, Deployment, Service] of the classifier server (the ConfigMap
    holds its program).

    serve.replicas pods of `image` (None: `serving_image`, vLLM's CPU image on a CPU accelerator), each with
    serve.tensor_parallel GPUs on a GPU accelerator, `resources` (else PodResources.of(serve): cpu, and memory
    where serve.memory_per_replica_gb gives it) as requests and limits, the claim mounted read-only at /model, a
    memory-backed /dev/shm (tensor parallelism exchanges through it), and /health probes: a startup probe that
    allows serve.startup_timeout_s for loading the model, then readiness and liveness. The Service is a ClusterIP
    on serve.port. Apply with `kubectl apply -f serving-k8s.yaml`.
    """
    _check_name(name)
    if not _SERVICE_NAME.fullmatch(name):
        raise UserError(
            f"name={name}: a Kubernetes Service name must start with a letter and end with a letter or digit",
            "rename the deployment",
        )
    claim, sub_path = _parse_pvc(model_uri)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "serving"}
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if sub_path:
        mount["subPath"] = sub_path
    classifier = kind == "vit"
    program = SERVER_PROGRAM.read_text() if classifier else None
    container: dict[str, Any] = {
        "name": "classifier" if classifier else "vllm",
        "image": image or serving_image(serve, accelerator),
        "command": ["python3", f"{PROGRAM_MOUNT}/{SERVER_PROGRAM.name}"] if classifier
        else ["python3", "-m", SERVER_MODULE],
        "args": program_args(serve, name, MODEL_MOUNT, accelerator, kind),
        "env": [{"name": key, "value": value} for key, value in sorted(program_env(serve, accelerator, kind).items())],
        "ports": [{"name": "http", "containerPort": serve.port, "protocol": "TCP"}],
        "startupProbe": _health_probe(math.ceil(serve.startup_timeout_s / PROBE_PERIOD_S)),
        "readinessProbe": _health_probe(3),
        "livenessProbe": _health_probe(3),
        "volumeMounts": [mount, {"name": "program", "mountPath": PROGRAM_MOUNT, "readOnly": True}] if classifier
        else [mount, {"name": "dshm", "mountPath": "/dev/shm"}],
    }  # fmt: skip
    pod = resources or PodResources.of(serve)
    amounts = pod.quantities() if pod else {"cpu": f"{math.ceil(serve.cpu_per_replica * 1000):d}m"}
    if accelerator != "cpu" and not classifier:  # the classifier server runs on CPU
        amounts[GPU_RESOURCE] = str(serve.tensor_parallel)
    container["resources"] = {"limits": dict(amounts), "requests": dict(amounts)}
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(serve.port),
        "prometheus.io/path": "/metrics",
    }
    volumes: list[dict[str, Any]] = [
        {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if program is not None:  # a changed program changes the pod template: the Deployment rolls its pods
        annotations[PROGRAM_DIGEST_ANNOTATION] = hashlib.sha256(program.encode()).hexdigest()
        volumes[1] = {"name": "program", "configMap": {"name": _program_map(name)}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": serve.namespace,
                     "labels": {**labels, "app.kubernetes.io/managed-by": "tdeploy"}},
        "spec": {
            "replicas": serve.replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels), "annotations": annotations},
                "spec": {
                    # Service links would put <SERVICE>_PORT=tcp://... into the environment, and vLLM reads
                    # VLLM_PORT as its own setting (it refuses to start when a Service is called vllm).
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": serve.namespace,
                     "labels": {**labels, "app.kubernetes.io/managed-by": "tdeploy"}},
        "spec": {
            "type": "ClusterIP",
            "selector": dict(labels),
            "ports": [{"name": "http", "port": serve.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    if program is None:
        return [deployment, service]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": _program_map(name), "namespace": serve.namespace,
                     "labels": {**labels, "app.kubernetes.io/managed-by": "tdeploy"}},
        "data": {SERVER_PROGRAM.name: program},
    }  # fmt: skip
    return [config_map, deployment, service]


def program_args(serve: ServeConfig, name: str, model_dir: str, accelerator: str, kind: ModelKind) -> list[str]:
    """The deployed server's arguments, on all interfaces: the classifier server's for model.kind vit, else vLLM's
    with the export's architecture (a vision-language model's --model-impl and --limit-mm-per-prompt)."""
    if kind == "vit":
        return classifier_args(serve, name, model_dir, host=ALL_INTERFACES)
    return server_args(serve, name, model_dir, accelerator, architecture=KIND_ARCHITECTURES.get(kind))


def program_env(serve: ServeConfig, accelerator: str, kind: ModelKind) -> dict[str, str]:
    """The deployed server's environment: vLLM's settings, or only SERVER_ENV for the classifier (no KV cache)."""
    return dict(SERVER_ENV) if kind == "vit" else server_env_vars(serve, accelerator)


def render_slurm(
    serve: ServeConfig, name: str, model_dir: str, python: str, *, accelerator: str, kind: ModelKind = "lm"
) -> str:
    """An sbatch script whose job is the server: one task on one node (serve.tensor_parallel GPUs on GPUs); for
    model.kind vit the classifier server, its program in a quoted here-document that `python -` reads (no GPU).

    `model_dir` is the model folder's absolute path on the cluster's shared filesystem and `python` the
    interpreter (a path, or a command on PATH) of an environment with vLLM on the compute nodes. The script
    waits for nothing: it logs where it listens and execs the server, which runs until scancel (or the
    partition's time limit). Every value is shell-quoted.
    """
    _check_name(name)
    if not model_dir.startswith("/") or _CONTROL.search(model_dir):
        raise UserError(
            f"model_dir={model_dir!r}: not an absolute path of one line",
            "give the model folder's absolute path on the cluster's shared filesystem",
        )
    if not python or _CONTROL.search(python):
        raise UserError(f"python={python!r}: not a command of one line", "give python3 or an interpreter's path")
    classifier = kind == "vit"
    directives = [f"--job-name={name}", "--nodes=1", "--ntasks=1"]
    if accelerator != "cpu" and not classifier:
        directives.append(f"--gres=gpu:{serve.tensor_parallel}")
    module = ["-"] if classifier else ["-m", SERVER_MODULE]
    command = [python, *module, *program_args(serve, name, model_dir, accelerator, kind)]
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(program_env(serve, accelerator, kind).items())]
    lines.append(f'echo "tdeploy: serving {name} on $(hostname):{serve.port:d} (job $SLURM_JOB_ID)"')
    if not classifier:
        return "\n".join([*lines, f"exec {shlex.join(command)}"]) + "\n"
    program = SERVER_PROGRAM.read_text()
    assert _HEREDOC_END not in program.splitlines(), "the here-document's end marker is a line of the program"
    lines += [f"exec {shlex.join(command)} <<'{_HEREDOC_END}'", program.rstrip("\n"), _HEREDOC_END]
    return "\n".join(lines) + "\n"


def serving_manifests(
    serve: ServeConfig,
    name: str,
    model_uri: str,
    image: str | None,
    accelerator: str,
    resources: PodResources | None = None,
    kind: ModelKind = "lm",
) -> dict[str, str]:
    """{serving-k8s.yaml: the Deployment and Service, serving.sbatch: the Slurm script}, rendered and checked, of
    the server of model.kind `kind` (vit: the classifier server and its ConfigMap).

    `model_uri` is the exported model folder: a path on the shared filesystem, which the Slurm script serves in
    place and the Kubernetes manifest expects at the root of the claim `<name>-model` (copy the folder onto it),
    or pvc://<claim>/<path>, which only Kubernetes can read (then no Slurm script). The Kubernetes objects are
    checked against the API's models; the script runs python3 from the compute nodes' PATH (activate an
    environment with vLLM, or edit that one word).
    """
    if model_uri.startswith("pvc://"):
        k8s_uri, slurm_dir = model_uri, None
    else:
        k8s_uri, slurm_dir = f"pvc://{name}-model", str(Path(model_uri).resolve())
    objects = render_kubernetes(serve, name, k8s_uri, image, accelerator=accelerator, resources=resources, kind=kind)
    validate_kubernetes(objects)
    files = {K8S_FILE: yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)}
    if slurm_dir is not None:
        files[SLURM_FILE] = render_slurm(serve, name, slurm_dir, "python3", accelerator=accelerator, kind=kind)
    return files


def write_manifests(
    serve: ServeConfig,
    name: str,
    model_uri: str,
    out_dir: Path,
    image: str | None,
    accelerator: str,
    resources: PodResources | None = None,
    kind: ModelKind = "lm",
) -> list[Path]:
    """Write `serving_manifests` (checked before anything is written) into `out_dir`; their paths."""
    files = serving_manifests(serve, name, model_uri, image, accelerator, resources, kind)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, text in files.items():
        (out_dir / file_name).write_text(text)
        written.append(out_dir / file_name)
    return written


def validate_kubernetes(objects: list[dict[str, Any]]) -> None:
    """Raise UserError unless each object is a valid apps/v1 Deployment, v1 Service or v1 ConfigMap of the
    Kubernetes API.

    Deserialising into the client's models rejects missing required fields and wrong types; the round trip must
    give the object back unchanged, which rejects unknown or misplaced fields; then the objects are checked against
    the API's JSON schemas (kubernetes-validate, `validate_manifests`), which also check values' formats.
    """
    from kubernetes.client import ApiClient

    client = ApiClient()
    for obj in objects:
        kind = {"Deployment": "V1Deployment", "Service": "V1Service", "ConfigMap": "V1ConfigMap"}.get(
            obj.get("kind", "")
        )
        if kind is None:
            raise UserError(f"{obj.get('kind')!r} is not a kind this module renders", "this is a rendering bug")
        check_round_trip(client, obj, kind, obj["kind"], "this is a rendering bug; report it")
    validate_manifests(objects)


def _health_probe(failure_threshold: int) -> dict[str, Any]:
    """GET /health on the container's http port every PROBE_PERIOD_S, failing after `failure_threshold` misses."""
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


class _Dumper(yaml.SafeDumper):
    """yaml.safe_dump's dumper with multi-line strings (the classifier server's program) as literal blocks, which a
    reader can read; every other value as safe_dump writes it."""


def _literal_block(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _literal_block)


def _program_map(name: str) -> str:
    """The classifier server's ConfigMap of deployment `name`."""
    return f"{name}-classifier-server"


def _check_name(name: str) -> None:
    if not re.fullmatch(NAME_PATTERN, name):
        raise UserError(f"name={name!r}: not a deployment name", "use lowercase letters, digits and -, at most 63")


def _parse_pvc(uri: str) -> tuple[str, str]:
    """(claim, path inside it) of pvc://<claim>[/<path>]."""
    fix = "copy the model folder onto a PersistentVolumeClaim and pass pvc://<claim>/<path inside it>"
    if not uri.startswith("pvc://"):
        raise UserError(f"model_uri={uri!r}: a Kubernetes pod reads the model from a volume, not from here", fix)
    claim, _, sub_path = uri[len("pvc://") :].partition("/")
    parts = [part for part in sub_path.split("/") if part]
    if not (_CLAIM.fullmatch(claim) and len(claim) <= 253):
        raise UserError(f"model_uri={uri!r}: {claim!r} is not a claim name (lowercase DNS name)", fix)
    if not all(_PATH_PART.fullmatch(part) for part in parts):
        raise UserError(
            f"model_uri={uri!r}: the path in the claim may hold letters, digits, '.', '_', '-' and '/' only (no '..')",
            fix,
        )
    return claim, "/".join(parts)
