"""`tdeploy serve` on a ViT spec starts the classifier server the serving check starts (not vLLM): a tiny random
ViT folder as the export writes it, one server start, a classify request answered, metrics served, SIGTERM stops
it with 143 and its log lands in the serving folder."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from PIL import Image

from tasks.launch.torchrun import free_port
from tests.conftest import REPO
from tests.processes import start_group, stop_group

pytestmark = pytest.mark.integration

SIDE, LABELS = 16, 3


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny random ViTForImageClassification and its ViTImageProcessor, saved with save_pretrained."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    folder = tmp_path / "vit"
    torch.manual_seed(0)
    names = {i: f"class-{i}" for i in range(LABELS)}
    config = ViTConfig(image_size=SIDE, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64, num_labels=LABELS, id2label=names,
                       label2id={v: k for k, v in names.items()})  # fmt: skip
    ViTForImageClassification(config).eval().save_pretrained(folder)
    ViTImageProcessor(size={"height": SIDE, "width": SIDE}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        folder
    )
    return folder


def _vit_spec(tmp_path: Path, port: int) -> Path:
    data = yaml.safe_load((REPO / "examples" / "vit.yaml").read_text())
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    data["data"] = {"dataset_url": str(dataset)}
    data["deployment_dir"] = str(tmp_path / "deployment")
    data["serve"] = {"port": port, "startup_timeout_s": 120, "classifier": {"threads": 1}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_tdeploy_serve_on_a_vit_spec_starts_the_classifier_server_not_vllm(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "serve.out"
    command = [sys.executable, "-c", "from flows.cli import main; main()", "serve", str(_vit_spec(tmp_path, port)),
               "--model-dir", str(model_dir)]  # fmt: skip
    with out.open("w") as sink:
        proc = start_group(command, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ), cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops it" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        text = out.read_text()
        assert "with the classifier server at" in text and f"http://127.0.0.1:{port}/v1/classify" in text, text
        pid = int(re.search(r"\(pid (\d+)\)", text).group(1))
        cmdline = " ".join(psutil.Process(pid).cmdline())
        assert "classifier_server.py" in cmdline and "vllm" not in cmdline, cmdline
        buffer = io.BytesIO()
        Image.new("RGB", (SIDE, SIDE), (200, 30, 90)).save(buffer, format="PNG")
        body = json.dumps({"images": [base64.b64encode(buffer.getvalue()).decode()]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/classify", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as response:
            (prediction,) = json.loads(response.read())["predictions"]
        assert 0 <= prediction["label_id"] < LABELS
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            assert "vllm:e2e_request_latency_seconds" in response.read().decode()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, out.read_text()
    finally:
        stop_group(proc)
    assert f"stopped the classifier server (pid {pid}) on SIGTERM" in out.read_text()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "deployment" / "serving" / "server.log").is_file()  # where the serving check writes too
