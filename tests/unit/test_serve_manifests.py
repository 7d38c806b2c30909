"""Serving manifests: Kubernetes objects the API accepts, probes and GPUs from the spec, a quoted sbatch script."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tasks.errors import UserError
from tasks.serve.config import ServeConfig
from tasks.serve.manifests import (
    REQUEST_LATENCY_BUCKETS_S,
    SERVER_MODULE,
    render_kubernetes,
    render_slurm,
    server_args,
    validate_kubernetes,
    write_manifests,
)

REPO = Path(__file__).resolve().parents[2]
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
GPU = "h100-sxm"
IMAGE = "docker.io/vllm/vllm-openai:v0.32.0"


def _serve(**fields: object) -> ServeConfig:
    return ServeConfig.model_validate(fields)


def _container(objects: list[dict]) -> dict:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_kubernetes_objects_are_a_deployment_and_a_service_the_api_models_accept() -> None:
    serve = _serve(tensor_parallel=4, replicas=3, max_model_len=2048, dtype="bfloat16")
    objects = render_kubernetes(serve, "llm", "pvc://models/llm/step-20", IMAGE, accelerator=GPU)
    assert [(o["apiVersion"], o["kind"]) for o in objects] == [("apps/v1", "Deployment"), ("v1", "Service")]
    validate_kubernetes(objects)
    deployment, service = objects
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert deployment["spec"]["template"]["metadata"]["labels"] == service["spec"]["selector"]
    assert service["spec"]["type"] == "ClusterIP"
    container = _container(objects)
    assert container["image"] == IMAGE
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def test_kubernetes_objects_pass_the_kubernetes_schemas_strictly() -> None:
    import kubernetes_validate

    for accelerator in (GPU, "cpu"):
        for obj in render_kubernetes(_serve(tensor_parallel=2), "llm", "pvc://models", IMAGE, accelerator=accelerator):
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_validation_refuses_unknown_fields_and_wrong_types() -> None:
    objects = render_kubernetes(_serve(), "llm", "pvc://models", IMAGE, accelerator=GPU)
    unknown = copy.deepcopy(objects)
    _container(unknown)["livenessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(UserError, match="livenessProbe.httpGet.pathh"):
        validate_kubernetes(unknown)
    wrong_type = copy.deepcopy(objects)
    wrong_type[1]["spec"]["ports"][0]["port"] = "8000"
    with pytest.raises(UserError, match="spec.ports"):
        validate_kubernetes(wrong_type)
    missing = copy.deepcopy(objects)
    del _container(missing)["name"]
    with pytest.raises(UserError, match="invalid"):
        validate_kubernetes(missing)


def test_probes_ask_health_on_the_configured_port_and_startup_allows_the_startup_timeout() -> None:
    serve = _serve(port=8123, startup_timeout_s=605)
    objects = render_kubernetes(serve, "llm", "pvc://models", IMAGE, accelerator=GPU)
    container = _container(objects)
    assert container["ports"] == [{"name": "http", "containerPort": 8123, "protocol": "TCP"}]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/health", "port": "http"}, kind
    startup = container["startupProbe"]
    assert 605 <= startup["periodSeconds"] * startup["failureThreshold"] < 605 + startup["periodSeconds"]
    assert container["args"][container["args"].index("--port") + 1] == "8123"
    assert objects[1]["spec"]["ports"] == [{"name": "http", "port": 8123, "targetPort": "http", "protocol": "TCP"}]


@pytest.mark.parametrize("tensor_parallel", [1, 2, 8])
def test_each_pod_asks_for_tensor_parallel_gpus_on_gpus_and_none_on_cpu(tensor_parallel: int) -> None:
    serve = _serve(tensor_parallel=tensor_parallel)
    container = _container(render_kubernetes(serve, "llm", "pvc://models", IMAGE, accelerator=GPU))
    gpus = {"cpu": "4000m", "nvidia.com/gpu": str(tensor_parallel)}
    assert container["resources"] == {"limits": gpus, "requests": gpus}
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(tensor_parallel)
    cpu = _container(render_kubernetes(_serve(), "llm", "pvc://models", IMAGE, accelerator="cpu"))
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in cpu["env"]
    assert "--gpu-memory-utilization" not in cpu["args"]


def test_the_model_comes_read_only_from_the_claim_and_path_of_the_uri() -> None:
    objects = render_kubernetes(_serve(), "llm", "pvc://shared-models/runs/llm/step-20/", IMAGE, accelerator=GPU)
    pod = objects[0]["spec"]["template"]["spec"]
    claim = {"claimName": "shared-models", "readOnly": True}
    assert {"name": "model", "persistentVolumeClaim": claim} in pod["volumes"]
    mount = next(m for m in _container(objects)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/model", "readOnly": True, "subPath": "runs/llm/step-20"}
    args = _container(objects)["args"]
    assert args[args.index("--model") + 1] == "/model"
    assert pod["enableServiceLinks"] is False  # else a Service called vllm sets VLLM_PORT=tcp://... in the pod


def test_server_arguments_carry_the_serve_section_and_the_latency_buckets_of_the_alerts() -> None:
    serve = _serve(dtype="float16", max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.85, port=9000)
    args = server_args(serve, "llm", "/m", GPU)
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--model": "/m",
        "--served-model-name": "llm",
        "--host": "0.0.0.0",
        "--port": "9000",
        "--dtype": "float16",
        "--max-model-len": "1024",
        "--max-num-seqs": "64",
        "--tensor-parallel-size": "1",
        "--gpu-memory-utilization": "0.85",
        "--custom-histogram-buckets": json.dumps({"request_latency": list(REQUEST_LATENCY_BUCKETS_S)}),
    }
    assert "--max-model-len" not in server_args(_serve(), "llm", "/m", GPU)  # None: the model's own limit
    assert {0.15, 0.3} <= set(REQUEST_LATENCY_BUCKETS_S)
    assert list(REQUEST_LATENCY_BUCKETS_S) == sorted(set(REQUEST_LATENCY_BUCKETS_S))


@pytest.mark.skipif(not SERVE_PYTHON.exists(), reason=".venv-serve missing: bash .ci/setup makes it")
def test_vllms_own_parser_accepts_the_server_arguments() -> None:
    args = server_args(_serve(tensor_parallel=2, max_model_len=512), "llm", "/m", GPU)
    probe = textwrap.dedent(
        """
        import json, sys
        from vllm.config import ObservabilityConfig
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
        ObservabilityConfig(custom_histogram_buckets=a.custom_histogram_buckets)
        print(json.dumps([a.model, a.served_model_name, a.port, a.tensor_parallel_size, a.custom_histogram_buckets]))
        """
    )
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(SERVE_PYTHON), "-c", probe, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == ["/m", ["llm"], 8000, 2, {"request_latency": list(REQUEST_LATENCY_BUCKETS_S)}]


def test_sbatch_script_is_valid_bash_that_asks_one_node_and_tensor_parallel_gpus(tmp_path: Path) -> None:
    serve = _serve(tensor_parallel=4)
    script = render_slurm(serve, "llm", "/shared/models/llm", "/opt/vllm/bin/python", accelerator=GPU)
    (tmp_path / "serving.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "serving.sbatch")]).returncode == 0
    lines = script.splitlines()
    for directive in ("#SBATCH --job-name=llm", "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --gres=gpu:4"):
        assert directive in lines, directive
    assert lines[-1].startswith("exec /opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model ")
    cpu = render_slurm(_serve(), "llm", "/shared/models/llm", "python3", accelerator="cpu")
    assert "--gres" not in cpu and "export VLLM_CPU_KVCACHE_SPACE=1" in cpu.splitlines()


def test_sbatch_script_hands_hostile_paths_to_the_server_unchanged(tmp_path: Path) -> None:
    # a stand-in interpreter, in a folder whose name is itself shell syntax, that records the words it gets
    bin_dir = tmp_path / "py $(touch pwned-python) `touch pwned-tick`"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    python.chmod(0o755)
    model_dir = '/shared/it\'s a $(touch pwned-model); rm -rf "$HOME" & dir\\n'
    serve = _serve(tensor_parallel=2)
    script = tmp_path / "serving.sbatch"
    script.write_text(render_slurm(serve, "llm", model_dir, str(python), accelerator=GPU))
    env = {**os.environ, "ARGV_OUT": str(tmp_path / "argv"), "SLURM_JOB_ID": "7", "HOME": str(tmp_path / "home")}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "tdeploy: serving llm on " in proc.stdout
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv == ["-m", SERVER_MODULE, *server_args(serve, "llm", model_dir, GPU)]
    assert not list(tmp_path.rglob("pwned-*"))


@pytest.mark.parametrize("name", ["x; rm -rf /", "$(id)", "llm\n#SBATCH --uid=0", "LLM", "a" * 64])
def test_a_hostile_or_malformed_name_is_refused_by_both_renderers(name: str) -> None:
    with pytest.raises(UserError, match="not a deployment name"):
        render_kubernetes(_serve(), name, "pvc://models", IMAGE, accelerator=GPU)
    with pytest.raises(UserError, match="not a deployment name"):
        render_slurm(_serve(), name, "/m", "python3", accelerator=GPU)


def test_a_name_kubernetes_cannot_give_a_service_is_refused_with_the_fix() -> None:
    with pytest.raises(UserError, match="must start with a letter") as caught:
        render_kubernetes(_serve(), "7b-model", "pvc://models", IMAGE, accelerator=GPU)
    assert "rename the deployment" in str(caught.value)


@pytest.mark.parametrize(
    "uri",
    [
        "/shared/models/llm",
        "s3://bucket/llm",
        "pvc://Models/llm",
        "pvc://models/../etc",
        "pvc://models/llm/$(id)",
        "pvc://models/llm;rm",
        "pvc://models/.hidden",
    ],
)
def test_a_model_uri_a_pod_cannot_mount_safely_is_refused(uri: str) -> None:
    with pytest.raises(UserError, match="model_uri="):
        render_kubernetes(_serve(), "llm", uri, IMAGE, accelerator=GPU)


@pytest.mark.parametrize("model_dir", ["relative/model", "/m\nexec evil", "/m\x00"])
def test_a_model_dir_slurm_cannot_use_is_refused(model_dir: str) -> None:
    with pytest.raises(UserError, match="model_dir="):
        render_slurm(_serve(), "llm", model_dir, "python3", accelerator=GPU)


def test_the_spec_refuses_a_hostile_image_and_no_replicas() -> None:
    assert ServeConfig().image == IMAGE and ServeConfig().replicas == 1
    for image in ("vllm/vllm-openai:v1; rm -rf /", "vllm/vllm-openai:$(id)", "Vllm/Openai", ""):
        with pytest.raises(ValidationError, match="image"):
            _serve(image=image)
    with pytest.raises(ValidationError, match="replicas"):
        _serve(replicas=0)
    assert _serve(image="registry.example.com:5000/ml/vllm@sha256:" + "a" * 64).image.endswith("a" * 64)


def test_write_manifests_writes_both_files_for_a_shared_folder(tmp_path: Path) -> None:
    serve = _serve(tensor_parallel=2)
    written = write_manifests(serve, "llm", str(tmp_path / "export" / "step-20"), tmp_path / "out", IMAGE, GPU)
    assert written == [tmp_path / "out" / "serving-k8s.yaml", tmp_path / "out" / "serving.sbatch"]
    objects = list(yaml.safe_load_all(written[0].read_text()))
    assert objects == render_kubernetes(serve, "llm", "pvc://llm-model", IMAGE, accelerator=GPU)
    assert "&id" not in written[0].read_text()  # plain YAML, no anchors
    script = written[1].read_text()
    assert script == render_slurm(serve, "llm", str(tmp_path / "export" / "step-20"), "python3", accelerator=GPU)
    assert subprocess.run(["bash", "-n", str(written[1])]).returncode == 0


def test_write_manifests_writes_only_kubernetes_for_a_claim_and_nothing_when_invalid(tmp_path: Path) -> None:
    written = write_manifests(_serve(), "llm", "pvc://models/llm", tmp_path / "out", IMAGE, GPU)
    assert written == [tmp_path / "out" / "serving-k8s.yaml"]
    with pytest.raises(UserError):
        write_manifests(_serve(), "7b", "/shared/m", tmp_path / "bad", IMAGE, GPU)
    assert not (tmp_path / "bad").exists()
