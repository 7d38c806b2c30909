"""The image classifier served by tasks/serve/classifier_server.py: a tiny random ViT saved as the export writes
it (config.json, model.safetensors, preprocessor_config.json), one server start for the module (the serving
environment's Python, as the serving check starts it), PNG images classified concurrently with parity to
transformers in this process, accuracy and macro F1 against known labels, bad input refused, the server stopped by
its PID at the end."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
import yaml
from PIL import Image

from tasks.launch.torchrun import free_port
from tasks.serve.check import ServingCheckConfig
from tasks.serve.classifier import (
    ClassifierReport, ClassifierServingResult, HeldOutImages, Measured, encode_png, held_out_images, judge_measured,
    measure, start_classifier,
)  # fmt: skip
from tasks.serve.classifier_config import ClassifierCheckConfig, ClassifierServeConfig
from tasks.serve.config import ServeConfig
from tasks.serve.report import write_reports
from tasks.serve.server import Server
from training.image_dataset import write_image_dataset

pytestmark = pytest.mark.integration

SIDE, LABELS, IMAGES = 16, 4, 24
MAX_PIXELS = 64 * 64
MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random ViTForImageClassification and its ViTImageProcessor, saved with save_pretrained."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    folder = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    names = {i: f"class-{i}" for i in range(LABELS)}
    config = ViTConfig(image_size=SIDE, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, num_labels=LABELS, id2label=names,
                       label2id={v: k for k, v in names.items()})  # fmt: skip
    ViTForImageClassification(config).eval().save_pretrained(folder)
    ViTImageProcessor(size={"height": SIDE, "width": SIDE}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        folder
    )
    return folder


@pytest.fixture(scope="module")
def serve() -> ServeConfig:
    classifier = ClassifierServeConfig(
        max_batch=8, max_wait_ms=30.0, max_request_bytes=MAX_BYTES, max_image_pixels=MAX_PIXELS, threads=1,
        check=ClassifierCheckConfig(images_per_request=1, max_concurrency=6),
    )  # fmt: skip
    return ServeConfig(port=free_port(), startup_timeout_s=120, classifier=classifier,
                       check=ServingCheckConfig(metrics_interval_s=0.05))  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir: Path, serve: ServeConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serving") / "server.log"
    server = start_classifier(model_dir, serve, "tiny-vit", log_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """Random uint8 images (N, 3, H, W)."""
    return np.random.default_rng(0).integers(0, 256, (IMAGES, 3, SIDE, SIDE), dtype=np.uint8)


@pytest.fixture(scope="module")
def reference(model_dir: Path, images: np.ndarray) -> list[tuple[int, float]]:
    """transformers' own top-1 label and probability per image, one image at a time (independent of the server
    and of tasks/serve/classifier.py's local_predictions)."""
    from transformers import ViTForImageClassification, ViTImageProcessor

    processor = ViTImageProcessor.from_pretrained(model_dir)
    model = ViTForImageClassification.from_pretrained(model_dir).eval()
    out = []
    for image in images:
        pixels = processor(images=Image.fromarray(image.transpose(1, 2, 0)), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            probs = torch.softmax(model(pixel_values=pixels).logits[0], dim=-1)
        out.append((int(probs.argmax()), float(probs.max())))
    return out


@pytest.fixture(scope="module")
def measured(server: Server, serve: ServeConfig, images: np.ndarray) -> Measured:
    """The image load test against the server (concurrent single-image requests)."""
    return measure(server, encode_png(images), serve)


def _post(server: Server, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.url}/v1/classify", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_served_top1_labels_and_scores_equal_transformers_own(measured: Measured, reference: list) -> None:
    load = measured.load
    assert load.figures.failed == 0 and load.figures.images == IMAGES, load.figures.errors
    served = load.answers
    assert [a[0] for a in served] == [r[0] for r in reference]
    assert max(abs(a[1] - r[1]) for a, r in zip(served, reference, strict=True)) < 1e-5
    assert load.figures.images_per_s > 0 and load.figures.latency_ms.p99 >= load.figures.latency_ms.p50 > 0


def test_concurrent_requests_share_forward_passes(measured: Measured) -> None:
    server = measured.server
    assert server.batches is not None and server.mean_batch_images is not None
    assert server.batches * server.mean_batch_images == pytest.approx(IMAGES)
    assert server.batches < IMAGES, "six requests in flight with a 30 ms wait must share some forward passes"


def test_accuracy_and_macro_f1_of_the_served_answers_against_known_labels(
    measured: Measured, reference: list, serve: ServeConfig, tmp_path: Path
) -> None:
    predicted = [r[0] for r in reference]
    wrong = set(range(0, IMAGES, 3))  # every third label differs from the prediction
    labels = [(p + 1) % LABELS if i in wrong else p for i, p in enumerate(predicted)]
    quality, parity, checks = judge_measured(measured, HeldOutImages([], labels, LABELS, "val"), reference, serve)
    assert quality.accuracy == pytest.approx(1 - len(wrong) / IMAGES)
    f1s = []
    for c in range(LABELS):
        tp = sum(p == c and t == c for p, t in zip(predicted, labels, strict=True))
        fp = sum(p == c and t != c for p, t in zip(predicted, labels, strict=True))
        fn = sum(p != c and t == c for p, t in zip(predicted, labels, strict=True))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    assert quality.macro_f1 == pytest.approx(sum(f1s) / len(f1s))
    assert parity.top1_match == 1.0 and parity.images == IMAGES
    verdicts = {c.name: c.passed for c in checks}
    assert verdicts["top1_match"] and verdicts["score_abs_diff"] and verdicts["error_rate"]
    report = ClassifierReport(model_dir="m", step=3, url="u", server_pid=1, accelerator="cpu",
                              load=measured.load.figures, server=measured.server, classification=quality,
                              parity=parity, checks=checks, per_request_ms=measured.load.per_request_ms)  # fmt: skip
    files = write_reports(report, serve, "tiny-vit", tmp_path).files  # the writer of every kind's serving files
    written = json.loads(Path(files["json"]).read_text())
    manifests = list(yaml.safe_load_all((tmp_path / "serving-k8s.yaml").read_text()))
    assert [m["kind"] for m in manifests] == ["ConfigMap", "Deployment", "Service"]
    assert "exec python3 - --model " in (tmp_path / "serving.sbatch").read_text()  # the program on its stdin
    assert written["classification"]["accuracy"] == quality.accuracy and written["parity"]["top1_match"] == 1.0
    assert written["verdict"] == ("passed" if all(v is not False for v in verdicts.values()) else "failed")
    assert (tmp_path / "junit.xml").is_file() and (tmp_path / "latency_histogram.png").stat().st_size > 0
    assert f"{IMAGES}/{IMAGES}" in ClassifierServingResult.of(report).summary()


@pytest.mark.parametrize(
    ("images", "status", "words"),
    [
        ([base64.b64encode(b"GIF89a definitely not a picture").decode()], 400, "images[0]: not a PNG or JPEG"),
        (["%%%"], 400, "images[0]: not valid base64"),
        ("large", 400, "too large"),
        ("huge-body", 413, "--max-request-bytes"),
    ],
)
def test_bad_input_is_refused_naming_the_problem(server: Server, images: object, status: int, words: str) -> None:
    if images == "large":
        images = [_png_b64(Image.new("RGB", (SIDE, SIDE))), _png_b64(Image.new("RGB", (100, 100)))]
        words = "images[1]: image too large, 100x100"
    elif images == "huge-body":
        noise = np.random.default_rng(1).integers(0, 256, (60, 60, 3), dtype=np.uint8)
        images = [_png_b64(Image.fromarray(noise))] * 8
    code, answer = _post(server, json.dumps({"images": images}).encode())
    assert code == status and words in answer["error"], answer
    assert "Traceback" not in answer["error"]


def test_the_server_serves_metrics_and_health_and_stops_by_its_pid(server: Server, measured: Measured) -> None:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'vllm:e2e_request_latency_seconds_bucket{le="0.15",model_name="tiny-vit"}' in text
    assert 'http_requests_total{handler="/v1/classify",method="POST",status="4xx"}' in text
    assert server.health()
    server.stop()
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE
    assert not server.health(timeout_s=1)


def test_held_out_images_come_from_the_prepared_dataset_as_png(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (6, SIDE, SIDE, 3), dtype=np.uint8)
    targets = np.array([0, 1, 2, 3, 0, 1])
    url = str(tmp_path / "images")
    write_image_dataset(url, None, {"train": (pixels[:2], targets[:2]), "val": (pixels[2:], targets[2:])},
                        kind="labels", source_fingerprint="test", num_classes=LABELS)  # fmt: skip
    data = SimpleNamespace(dataset_url=url, val_split="val", train_split="train")
    held = held_out_images(SimpleNamespace(data=data, storage=None), 4)  # type: ignore[arg-type]
    assert (held.labels, held.num_classes, held.split) == ([2, 3, 0, 1], LABELS, "val")
    decoded = [np.asarray(Image.open(io.BytesIO(p))) for p in held.pngs]
    assert all((d == pixels[2 + i]).all() for i, d in enumerate(decoded))
