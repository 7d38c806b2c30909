"""cluster.kubernetes.api=trainjob: the Kubeflow Trainer v2 TrainJob (and runtime) that render_manifests gives,
checked against the vendored Trainer CRD schemas, and the semantics it keeps from the PyTorchJob."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from tasks.errors import UserError
from tasks.launch.kubernetes import KubernetesLauncher, render_manifests, validate_manifests
from tasks.launch.trainjob import CRD_DIR, CRD_RELEASE, NODE_JOB, crd_schema
from tasks.spec import load_spec
from training.config import FaultToleranceConfig
from training.health_gate import GATE_NODE_ENV

EXAMPLES = sorted(Path(__file__).parents[3].joinpath("examples").glob("*.yaml"))
KUBERNETES_EXAMPLES = [p for p in EXAMPLES if "scheduler: kubernetes" in p.read_text()]


def _pod(job: dict) -> dict:
    """The pod template the TrainJob patches onto the runtime's `node` job."""
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == NODE_JOB
    return replicated["template"]["spec"]["template"]


def _render(make_spec, cluster: dict | None = None, **overrides) -> tuple[list[dict], dict]:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, **(cluster or {})}, **overrides})
    objects = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_manifests(objects)
    return objects, objects[-1]


def test_the_vendored_crds_name_their_release_and_hold_the_v1alpha1_schemas() -> None:
    assert f"release tag **{CRD_RELEASE}**" in (CRD_DIR / "README.md").read_text()
    for kind in ("TrainJob", "ClusterTrainingRuntime"):
        assert crd_schema(kind)["properties"]["spec"]["type"] == "object"


@pytest.mark.parametrize("render_runtime", [False, True])
@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize("example", KUBERNETES_EXAMPLES, ids=[p.name for p in KUBERNETES_EXAMPLES])
def test_every_kubernetes_example_renders_objects_that_validate(example: Path, api: str, render_runtime: bool) -> None:
    spec = load_spec(example)
    k8s = spec.cluster.kubernetes.model_copy(update={"api": api, "render_runtime": render_runtime})
    cluster = spec.cluster.model_copy(update={"kubernetes": k8s})
    objects = render_manifests(cluster, spec.training_config(), "llm", "registry.example.com/ml/train:1")
    validate_manifests(objects)
    kinds = [o["kind"] for o in objects]
    if api == "pytorchjob":
        assert kinds == ["ConfigMap", "PyTorchJob"]
    else:
        assert kinds == ["ConfigMap", *(["ClusterTrainingRuntime"] if render_runtime else []), "TrainJob"]
        assert objects[-1]["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                                     "kind": "ClusterTrainingRuntime"}  # fmt: skip


def test_examples_with_the_kubernetes_scheduler_exist() -> None:
    assert KUBERNETES_EXAMPLES, "examples/kubernetes.yaml is what the rendering tests read"


@pytest.mark.parametrize(
    ("where", "value", "problem"),
    [
        (["spec", "trainer", "imagee"], "x", r"at spec\.trainer: Additional properties are not allowed \('imagee'"),
        (["spec", "trainer", "numNodes"], "two", r"at spec\.trainer\.numNodes: 'two' is not of type 'integer'"),
        (["spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0, "template",
          "spec", "template", "spec", "terminationGracePeriodSeconds"], -1,
         r"at spec\.runtimePatches\.0\..*\.terminationGracePeriodSeconds: -1 is less than the minimum of 0"),
        (["spec", "runtimeRef", "name"], "", r"at spec\.runtimeRef\.name: '' should be non-empty"),
    ],
    ids=["unknown-field", "wrong-type", "below-minimum", "empty-name"],
)
def test_a_trainjob_that_breaks_the_crd_schema_is_refused_naming_the_field(
    make_spec, where: list, value: object, problem: str
) -> None:
    objects, job = _render(make_spec)
    broken = copy.deepcopy(job)
    target = broken
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(UserError, match=r"TrainJob 'tiny' does not fit the Trainer v1alpha1 CRD " + problem):
        validate_manifests([objects[0], broken])


def test_core_objects_are_checked_against_the_kubernetes_schemas(make_spec) -> None:
    objects, _ = _render(make_spec)
    config_map = copy.deepcopy(objects[0])
    config_map["dataa"] = config_map.pop("data")
    with pytest.raises(UserError, match=r"ConfigMap 'tiny-config' is not a valid Kubernetes object"):
        validate_manifests([config_map])


def test_the_trainjob_runs_the_trainer_with_the_spec_env_and_the_key_from_a_secret_only(
    make_spec, monkeypatch
) -> None:
    monkeypatch.setenv("TDEPLOY_CHECKPOINT_KEY", "operator-key-0123456789")
    objects, job = _render(make_spec, {"procs_per_node": 2, "env": {"NCCL_DEBUG": "INFO"},
                                       "health_gate": {"level": "off"},
                                       "kubernetes": {"namespace": "train", "cpu_per_node": 8}})  # fmt: skip
    trainer = job["spec"]["trainer"]
    assert (trainer["image"], trainer["numNodes"], trainer["numProcPerNode"]) == ("img:1", 2, 2)
    assert trainer["command"][:3] == ["python", "-m", "training.preemption"]
    assert trainer["command"][-4:] == ["-m", "training.train", "--config", "/etc/tdeploy/run.json"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in trainer["env"]
    assert {"name": "TDEPLOY_CHECKPOINT_KEY",
            "valueFrom": {"secretKeyRef": {"name": "tdeploy-checkpoint-key", "key": "key", "optional": True}}
            } in trainer["env"]  # fmt: skip
    assert trainer["resourcesPerNode"] == {"limits": {"cpu": "8"}, "requests": {"cpu": "8"}}
    assert job["metadata"]["namespace"] == "train" and objects[0]["metadata"]["namespace"] == "train"
    assert "operator-key" not in json.dumps(objects)


def test_the_pods_get_dev_shm_the_config_the_grace_period_and_stay_off_excluded_nodes(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "preemption": {"grace_period_s": 240},
                                  "kubernetes": {"node_selector": {"nvidia.com/gpu.product": "H100"},
                                                 "tolerations": [{"taint": "nvidia.com/gpu", "operator": "Exists",
                                                                  "effect": "NoSchedule"}]}}})  # fmt: skip
    cluster = KubernetesLauncher.excluding(spec.cluster, ["gpu-node-7"])
    objects = render_manifests(cluster, spec.training_config(), "tiny", "img:1")
    validate_manifests(objects)
    pod = _pod(objects[-1])["spec"]
    assert pod["terminationGracePeriodSeconds"] == 240
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "tdeploy-config", "configMap": {"name": "tiny-config"}} in pod["volumes"]
    (node,) = pod["containers"]
    assert node["name"] == NODE_JOB
    assert {"name": "dshm", "mountPath": "/dev/shm"} in node["volumeMounts"]
    assert {"name": "tdeploy-config", "mountPath": "/etc/tdeploy", "readOnly": True} in node["volumeMounts"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                            "values": ["gpu-node-7"]}]}]  # fmt: skip
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_without_preemption_the_grace_period_is_the_clusters_default(make_spec) -> None:
    _, job = _render(make_spec, {"preemption": {"enabled": False}})
    assert "terminationGracePeriodSeconds" not in _pod(job)["spec"]


def test_the_health_gate_runs_before_the_trainer_in_its_container(make_spec) -> None:
    _, job = _render(make_spec, {"health_gate": {"storage_paths": ["/scratch"]}})
    trainer = job["spec"]["trainer"]
    assert trainer["command"][:2] == ["sh", "-c"]
    gate, train = trainer["command"][2].split(" && exec ")
    assert gate.startswith(f"python -m training.health_gate probe --name '$({GATE_NODE_ENV})' --alone --config ")
    assert gate.endswith("--storage /scratch") and train.startswith("python -m training.preemption ")
    assert {"name": GATE_NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in trainer["env"]


def test_the_metrics_port_is_announced_to_prometheus_on_the_pods(make_spec) -> None:
    _, job = _render(make_spec, run={"metrics_port": 9400})
    assert _pod(job)["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"}


def test_spares_make_an_elastic_rendezvous_of_exactly_the_nodes_among_more_pods(make_spec) -> None:
    _, job = _render(make_spec, {"procs_per_node": 1, "spares": 1, "max_restarts": 1, "health_gate": {"level": "off"}})
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 3
    assert {"--nnodes=2:2", "--rdzv-backend=c10d", "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"} <= set(
        trainer["command"]
    )


def test_the_rendered_runtime_restarts_a_failed_trainer_in_its_pod_up_to_max_restarts(make_spec) -> None:
    objects, _ = _render(make_spec, {"max_restarts": 3, "kubernetes": {"render_runtime": True, "runtime": "tdeploy"}})
    runtime = objects[1]
    assert (runtime["kind"], runtime["metadata"]["name"]) == ("ClusterTrainingRuntime", "tdeploy")
    assert objects[-1]["spec"]["runtimeRef"]["name"] == "tdeploy"
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["template"]["spec"]["backoffLimit"] == 3
    assert node["template"]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}


def test_replica_groups_on_trainjob_are_refused_naming_the_api_that_renders_them(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "procs_per_node": 2}})
    # the spec refuses replica groups on Kubernetes until its launcher submits them: the rendering on its own
    ft = FaultToleranceConfig(mode="replica_groups", replica_groups=2)
    train = spec.training_config().model_copy(update={"fault_tolerance": ft})
    with pytest.raises(UserError, match="set cluster.kubernetes.api: pytorchjob"):
        render_manifests(spec.cluster, train, "ft", "img:1")


def test_the_rendered_file_holds_the_objects_submit_creates(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "kubernetes": {"render_runtime": True}}})
    (job_file,) = KubernetesLauncher.rendered_files(spec.cluster, spec.training_config(), "tiny", "img:1")
    assert job_file.name == "kubernetes/job.yaml"
    assert list(yaml.safe_load_all(job_file.text)) == render_manifests(spec.cluster, spec.training_config(), "tiny",
                                                                       "img:1")  # fmt: skip
    assert "(ConfigMap, ClusterTrainingRuntime, TrainJob)" in job_file.what
