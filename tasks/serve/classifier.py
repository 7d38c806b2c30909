"""The serving check of an image classifier (model.kind vit): serve the exported ViT folder with transformers
behind tasks/serve/classifier_server.py, load-test it with held-out images, score its answers (accuracy, macro F1),
compare them with transformers' own predictions on the same images, and judge it all against the spec.

vLLM serves no image classification; the server runs from the serving environment's Python (`serve_python`,
.venv-serve: the packages of the vLLM serving image, which has transformers, Pillow, starlette and uvicorn), the
same interpreter and image that serve the language models, so one serving image serves every model kind.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tasks.errors import TransientError, UserError
from tasks.progress import report as report_progress
from tasks.results import StepResult
from tasks.serve.check import (
    REQUEST_TIMEOUT_S,
    Judged,
    LatencyPlot,
    MetricsSampler,
    p99_threshold,
    served_folder,
)
from tasks.serve.report import write_reports
from tasks.serve.server import (
    REQUEST_LATENCY_BUCKETS_S, SERVER_ENV, SERVER_LOG, Server, ServerStartFailed, ServerStartTimeout, check_port_free,
    first_error, log_tail, serve_python, with_folder_dtype,
)  # fmt: skip
from validation.classifier_serving import (
    ClassificationFigures, ClassifierParityFigures, ImageLoadFigures, classification_figures, compare_predictions,
    judge_classifier,
)  # fmt: skip
from validation.serving import LatencyFigures, ServingCheck

if TYPE_CHECKING:
    import torch

    from tasks.export.readme import AcceptanceFigures
    from tasks.serve.classifier_config import ClassifierCheckConfig
    from tasks.serve.config import ServeConfig
    from training.config import TrainConfig

log = logging.getLogger(__name__)

SERVER_PROGRAM = Path(__file__).with_name("classifier_server.py")
"""The server program, run by path: it imports none of this repository (the serving image runs it as it is)."""
PREPROCESSOR = "preprocessor_config.json"
BATCH_METRIC = "tdeploy:classifier_batch_images"
_POLL_S = 0.25
_KEEP_ERRORS = 5


def classifier_args(serve: ServeConfig, served_name: str, model_dir: str, *, host: str | None = None) -> list[str]:
    """Arguments of the classifier server for `model_dir`, served as `served_name` on host (default serve.host):
    serve.port; the one place its flags are spelt (this machine's server, the Kubernetes and Slurm manifests)."""
    cfg = serve.classifier
    args = [
        "--model", model_dir, "--served-model-name", served_name,
        "--host", host or serve.host, "--port", str(serve.port),
        "--max-batch", str(cfg.max_batch), "--max-wait-ms", repr(cfg.max_wait_ms),
        "--max-request-bytes", str(cfg.max_request_bytes), "--max-image-pixels", str(cfg.max_image_pixels),
        "--latency-buckets-s", json.dumps(list(REQUEST_LATENCY_BUCKETS_S)),
    ]  # fmt: skip
    if serve.dtype is not None:
        args += ["--dtype", serve.dtype]
    if cfg.threads is not None:
        args += ["--threads", str(cfg.threads)]
    return args


def classifier_command(model_dir: Path, serve: ServeConfig, served_name: str) -> list[str]:
    """The argv of the classifier server for `model_dir` on serve.host:serve.port (run without a shell)."""
    return [str(serve_python()), str(SERVER_PROGRAM), *classifier_args(serve, served_name, str(model_dir))]


def start_classifier(
    model_dir: Path, serve: ServeConfig, served_name: str, log_path: Path, on_wait: Any = None
) -> Server:
    """Start the classifier server on `model_dir` (a Hugging Face image classifier folder) in a session of its
    own, its output in `log_path`; return once /health answers 200 (stopped by PID with Server.stop)."""
    for name in ("config.json", PREPROCESSOR):
        if not (model_dir / name).is_file():
            raise UserError(f"{model_dir}: no {name}; not a Hugging Face image classifier folder",
                            "serve the folder the export writes for model.kind vit")  # fmt: skip
    check_port_free(serve.host, serve.port)
    serve = with_folder_dtype(serve, model_dir)
    command = classifier_command(model_dir.resolve(), serve, served_name)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting the classifier server: %s (log %s)", " ".join(command), log_path)
    env = {**SERVER_ENV, **os.environ}
    with log_path.open("wb") as out:
        proc = subprocess.Popen(  # noqa: S603 - argv of validated values, no shell
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    host = "127.0.0.1" if serve.host == "0.0.0.0" else serve.host  # noqa: S104 - the address clients dial
    server = Server(f"http://{host}:{serve.port}", proc.pid, log_path, served_name, proc)
    try:
        _wait_ready(server, proc, serve.startup_timeout_s, on_wait)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: Server, proc: subprocess.Popen, timeout_s: float, on_wait: Any) -> None:
    started = time.monotonic()
    next_note = started + 30
    while not server.health():
        if proc.poll() is not None:
            cause = first_error(server.log_path)
            raise ServerStartFailed(
                f"the classifier server exited with {proc.returncode} before it answered /health"
                + (f" ({cause})" if cause else ""),
                f"read {server.log_path} (a folder transformers cannot load is named there)",
                server.log_path, log_tail(server.log_path), proc.returncode,
            )  # fmt: skip
        now = time.monotonic()
        if now - started > timeout_s:
            raise ServerStartTimeout(
                f"the classifier server did not answer {server.url}/health within serve.startup_timeout_s="
                f"{timeout_s:g}; it was stopped", "raise serve.startup_timeout_s or try again on a less busy machine",
                server.log_path, log_tail(server.log_path), timeout_s,
            )  # fmt: skip
        if now >= next_note and on_wait is not None:
            on_wait(now - started)
            next_note = now + 30
        time.sleep(_POLL_S)
    log.info("classifier server at %s ready after %.1f s", server.url, time.monotonic() - started)


def encode_png(images: torch.Tensor | np.ndarray) -> list[bytes]:
    """uint8 images (N, 3, H, W) as PNG files."""
    from PIL import Image

    array = np.asarray(images, dtype=np.uint8)
    out = []
    for image in array:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0)), mode="RGB").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


@dataclass(frozen=True)
class HeldOutImages:
    """PNG files of held-out images and their labels."""

    pngs: list[bytes]
    labels: list[int]
    num_classes: int
    split: str


def held_out_images(train: TrainConfig, count: int) -> HeldOutImages:
    """`count` images of the image dataset's held-out split (the training split when there is none), spread over
    the split, as PNG files with their labels."""
    from training.image_dataset import ImageDataset, read_image_manifest

    url = train.data.dataset_url
    splits = read_image_manifest(url, train.storage).splits
    split = train.data.val_split if train.data.val_split in splits else train.data.train_split
    data = ImageDataset(url, split, train.storage, expect_kind="labels")
    stride = max(1, len(data) // count)
    batch = data.batch([(i * stride) % len(data) for i in range(count)])
    num_classes = data.manifest.num_classes
    assert num_classes is not None, "a labels dataset records its classes"
    return HeldOutImages(encode_png(batch.images), batch.targets.tolist(), num_classes, split)


def local_predictions(model_dir: Path, pngs: list[bytes], dtype: str = "float32",
                      batch: int = 32) -> list[tuple[int, float]]:  # fmt: skip
    """transformers' own top-1 (label id, probability) of each PNG: the folder loaded with AutoImageProcessor and
    AutoModelForImageClassification in this process, as a user of the exported folder would."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(model_dir)
    model = AutoModelForImageClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    out: list[tuple[int, float]] = []
    for start in range(0, len(pngs), batch):
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs[start : start + batch]]
        pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(model.dtype)
        with torch.inference_mode():
            probs = torch.softmax(model(pixel_values=pixels).logits.float(), dim=-1)
        best, ids = probs.max(dim=-1)
        out += list(zip(ids.tolist(), best.tolist(), strict=True))
    return out


def classify(url: str, pngs: list[bytes], top_k: int = 1, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST the PNG files to the server's /v1/classify; its JSON answer. A refused request (4xx) is a UserError
    quoting the server's reason, another failure a TransientError."""
    body = json.dumps({"images": [base64.b64encode(p).decode() for p in pngs], "top_k": top_k}).encode()
    request = urllib.request.Request(f"{url}/v1/classify", data=body, headers={"Content-Type": "application/json"},
                                     method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 - our own server
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        reason = err.read().decode("utf-8", "replace")[:2000]
        kind = UserError if 400 <= err.code < 500 else TransientError
        raise kind(f"classify: the server at {url} answered HTTP {err.code}: {reason}", "see the server log") from err
    except OSError as err:
        raise TransientError(f"classify: request to {url} failed: {err}", "see the server log") from err


def percentiles(latencies_ms: list[float]) -> LatencyFigures:
    """P50, P95, P99 (linear interpolation) and mean of latencies in ms; NaN when there are none."""
    if not latencies_ms:
        return LatencyFigures(math.nan, math.nan, math.nan, math.nan)
    p50, p95, p99 = np.percentile(np.asarray(latencies_ms, dtype=np.float64), [50, 95, 99]).tolist()
    return LatencyFigures(p50=p50, p95=p95, p99=p99, mean=float(np.mean(latencies_ms)))


@dataclass(frozen=True)
class ImageLoad:
    """The image load test's figures, each request's latency and each image's served (label id, probability)."""

    figures: ImageLoadFigures
    per_request_ms: list[float]
    answers: list[tuple[int, float] | None]
    """Per image, None where its request failed."""


def run_image_load(url: str, pngs: list[bytes], check: ClassifierCheckConfig) -> ImageLoad:
    """Send the images in requests of check.images_per_request, check.max_concurrency at a time; latency per
    request as the client sees it, images/s over the whole load."""
    size = check.images_per_request
    groups = [list(range(i, min(i + size, len(pngs)))) for i in range(0, len(pngs), size)]
    answers: list[tuple[int, float] | None] = [None] * len(pngs)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def send(group: list[int]) -> None:
        started = time.perf_counter()
        try:
            predictions = classify(url, [pngs[i] for i in group])["predictions"]
            if len(predictions) != len(group):
                raise TransientError(f"{len(predictions)} predictions for {len(group)} images", "see the server log")
        except (UserError, TransientError, KeyError, ValueError) as err:
            with lock:
                if len(errors) < _KEEP_ERRORS and str(err) not in errors:
                    errors.append(str(err))
            return
        elapsed_ms = 1000.0 * (time.perf_counter() - started)
        with lock:
            latencies.append(elapsed_ms)
            for i, p in zip(group, predictions, strict=True):
                answers[i] = (int(p["label_id"]), float(p["score"]))

    started = time.perf_counter()
    with ThreadPoolExecutor(check.max_concurrency, "image-load") as pool:
        futures = [pool.submit(send, g) for g in groups]
        try:
            for future in futures:
                future.result(timeout=max(0.0, started + check.load_timeout_s - time.perf_counter()))
        except FuturesTimeout as err:
            for future in futures:
                future.cancel()
            raise TransientError(
                f"the image load test ran past serve.classifier.check.load_timeout_s={check.load_timeout_s:g}",
                "raise the timeout or lower serve.classifier.check.num_images",
            ) from err
    duration_s = time.perf_counter() - started
    done = sum(1 for a in answers if a is not None)
    figures = ImageLoadFigures(
        requests=len(groups), failed=len(groups) - len(latencies), images=done, duration_s=duration_s,
        images_per_s=done / duration_s if duration_s > 0 else math.nan,
        requests_per_s=len(latencies) / duration_s if duration_s > 0 else math.nan,
        latency_ms=percentiles(latencies), max_concurrency=check.max_concurrency, images_per_request=size,
        errors=errors,
    )  # fmt: skip
    return ImageLoad(figures, latencies, answers)


@dataclass(frozen=True)
class ClassifierServerFigures:
    """The server's own metrics over the load test: queue and batch maxima sampled, batches counted."""

    samples: int
    running_max: float | None
    waiting_max: float | None
    batches: float | None
    """Forward passes the load took (the batch histogram's count, after minus before)."""
    mean_batch_images: float | None
    """Images per forward pass: above 1 only when the server batched requests together."""


def server_figures(sampler: MetricsSampler) -> ClassifierServerFigures:
    """The sampler's maxima and the batch histogram's growth from its first scrape to its last."""

    def delta(name: str) -> float | None:
        return sampler.last[name] - sampler.first.get(name, 0.0) if name in sampler.last else None

    batches, images = delta(f"{BATCH_METRIC}_count"), delta(f"{BATCH_METRIC}_sum")
    return ClassifierServerFigures(
        samples=sampler.samples, running_max=sampler.maxima.get("running_max"),
        waiting_max=sampler.maxima.get("waiting_max"), batches=batches,
        mean_batch_images=images / batches if batches and images is not None else None,
    )  # fmt: skip


@dataclass(frozen=True)
class ClassifierReport(Judged):
    """Everything the classifier's serving check measured and judged."""

    MODEL_KIND: ClassVar[str] = "vit"

    model_dir: str
    step: int
    url: str
    server_pid: int
    """The server's process (group) id: gone when the check ends."""
    accelerator: str
    load: ImageLoadFigures
    server: ClassifierServerFigures
    classification: ClassificationFigures
    parity: ClassifierParityFigures
    checks: list[ServingCheck]
    per_request_ms: list[float] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def latency_plot(self) -> LatencyPlot:
        """The image load test's latency per classify request, for the histogram."""
        return LatencyPlot(
            self.per_request_ms, self.load.latency_ms, p99_threshold(self.checks, "p99_latency_ms"),
            "latency per classify request (ms)",
            f"{self.load.requests} requests of {self.load.images_per_request} image(s), concurrency "
            f"{self.load.max_concurrency}, {self.load.images_per_s:.0f} images/s",
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """serving.json's content."""
        data = asdict(self)
        data.pop("per_request_ms")
        data["kind"] = "classifier"
        data["verdict"] = "passed" if self.passed else "failed"
        data["load"]["error_rate"] = self.load.error_rate
        data["parity"]["top1_match"] = self.parity.top1_match
        return data


@dataclass(frozen=True)
class Measured:
    """What the check measured on a running server."""

    load: ImageLoad
    server: ClassifierServerFigures


def measure(server: Server, pngs: list[bytes], serve: ServeConfig) -> Measured:
    """The image load test on `server` with its metrics sampled; a server that died meanwhile is the finding."""
    during = "the classifier's serving check (image load test)"
    try:
        classify(server.url, pngs[: serve.classifier.check.images_per_request])  # warm-up: not in the figures
        with MetricsSampler(server.url, serve.check.metrics_interval_s) as sampler:
            load = run_image_load(server.url, pngs, serve.classifier.check)
    except Exception as err:
        exited = server.exited(during, grace_s=5.0)
        if exited is not None:
            raise exited from err
        raise
    exited = server.exited(during)
    if exited is not None:
        raise exited
    return Measured(load, server_figures(sampler))


def judge_measured(measured: Measured, data: HeldOutImages, local: list[tuple[int, float]],
                   serve: ServeConfig) -> tuple[ClassificationFigures, ClassifierParityFigures, list[ServingCheck]]:  # fmt: skip
    """Accuracy and macro F1 of the served answers, their parity with `local`, and the verdict table, over the
    images the server answered (a failed request counts in the error rate)."""
    answered = [(i, a) for i, a in enumerate(measured.load.answers) if a is not None]
    quality = classification_figures([a[0] for _, a in answered], [data.labels[i] for i, _ in answered],
                                     data.num_classes, data.split)  # fmt: skip
    parity = compare_predictions([local[i] for i, _ in answered], [a for _, a in answered])
    checks = judge_classifier(measured.load.figures, quality, parity, serve.classifier.check.thresholds)
    return quality, parity, checks


def run_classifier_check(
    serve: ServeConfig,
    train: TrainConfig,
    accelerator: str,
    name: str,
    out_dir: Path,
    export_root: str,
    step: int | None = None,
    model_dir: str | None = None,
    acceptance: AcceptanceFigures | None = None,
    pod_memory_bytes: float | None = None,
) -> ClassifierReport:
    """Export the newest sound (or the given) checkpoint as a ViT folder (or take `model_dir` of checkpoint
    `step`), serve it, load-test it with held-out images, stop the server, write the serving check's files into
    `out_dir` (tasks/serve/report.py: serving.json, junit.xml, the latency histogram, the classifier's serving
    manifests, whose pods get `pod_memory_bytes`); the report says whether it passed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    served, served_step = served_folder(train, step, model_dir, export_root, acceptance, "the classifier server serves")
    serve = with_folder_dtype(serve, served)
    data = held_out_images(train, serve.classifier.check.num_images)
    local = local_predictions(served, data.pngs, serve.dtype or "float32")
    report_progress("serving", "starting the classifier server")
    server = start_classifier(served, serve, name, out_dir / SERVER_LOG)
    try:
        report_progress("serving", "image load test, accuracy and parity")
        measured = measure(server, data.pngs, serve)
    finally:
        server.stop()
    quality, parity, checks = judge_measured(measured, data, local, serve)
    report = ClassifierReport(
        model_dir=str(served), step=served_step, url=server.url, server_pid=server.pid, accelerator=accelerator,
        load=measured.load.figures, server=measured.server, classification=quality, parity=parity, checks=checks,
        per_request_ms=measured.load.per_request_ms, files={"server_log": str(out_dir / SERVER_LOG)},
    )  # fmt: skip
    return write_reports(report, serve, name, out_dir, pod_memory_bytes)


class ClassifierServingResult(StepResult):
    """The classifier's serving check: the served checkpoint, its latency, throughput, quality and parity."""

    verdict_text: str
    step: int
    model_dir: str
    p99_latency_ms: float
    images_per_s: float
    error_rate: float
    accuracy: float
    macro_f1: float
    top1_matched: int
    parity_images: int
    score_max_abs_diff: float
    files: dict[str, str]
    failed: list[str] = []

    @classmethod
    def of(cls, report: ClassifierReport) -> ClassifierServingResult:
        """The step's small result from the full report."""
        return cls(
            verdict_text="passed" if report.passed else "failed", step=report.step, model_dir=report.model_dir,
            p99_latency_ms=report.load.latency_ms.p99, images_per_s=report.load.images_per_s,
            error_rate=report.load.error_rate, accuracy=report.classification.accuracy,
            macro_f1=report.classification.macro_f1, top1_matched=report.parity.top1_matched,
            parity_images=report.parity.images, score_max_abs_diff=report.parity.score_max_abs_diff,
            files=report.files, failed=report.failed,
        )  # fmt: skip

    def summary(self) -> str:
        """Verdict, P99 latency, images/s, errors, accuracy, macro F1, parity and where serving.json is."""
        return (
            f"{self.verdict_text}: step {self.step}; P99 {self.p99_latency_ms:.1f} ms per request; "
            f"{self.images_per_s:.1f} images/s; errors {self.error_rate:.1%}; accuracy {self.accuracy:.1%}, "
            f"macro F1 {self.macro_f1:.3f} (0-1); top-1 parity {self.top1_matched}/{self.parity_images} "
            f"(score |diff| <= {self.score_max_abs_diff:.1e}); `{self.files.get('json', '-')}`"
        )
