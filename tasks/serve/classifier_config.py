"""`serve.classifier`: how an image classifier (model.kind vit) is served and checked (tasks/serve/classifier.py)."""

from __future__ import annotations

from pydantic import Field

from training.config import StrictModel
from validation.classifier_serving import ClassifierThresholds


class ClassifierCheckConfig(StrictModel):
    """The classifier's serving check: the image load test and its thresholds (`serve.classifier.check`)."""

    num_images: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Held-out images the load test sends (PNG-encoded); the served answers to them give accuracy, "
        "macro F1 and the parity with transformers' own predictions.",
    )
    images_per_request: int = Field(
        default=1, ge=1, le=4096, description="Images in each classify request (at most serve.classifier.max_batch)."
    )
    max_concurrency: int = Field(default=8, ge=1, le=100_000, description="Load test: most requests in flight.")
    load_timeout_s: float = Field(default=600.0, gt=0, le=86_400, description="Most time the load test may take.")
    thresholds: ClassifierThresholds = Field(
        default_factory=ClassifierThresholds,
        description="Pass thresholds: P99 latency, errors, images/s, accuracy, macro F1 and parity.",
    )


class ClassifierServeConfig(StrictModel):
    """The image classifier's server (tasks/serve/classifier_server.py, transformers behind HTTP): vLLM serves no
    image classification."""

    max_batch: int = Field(
        default=16, ge=1, le=4096, description="Most images one forward pass runs (dynamic batching)."
    )
    max_wait_ms: float = Field(
        default=5.0,
        ge=0,
        le=10_000,
        description="Longest a request waits for others to share its forward pass, in ms (0: run what is queued).",
    )
    max_request_bytes: int = Field(
        default=16 * 2**20,
        ge=1024,
        le=2**31,
        description="Largest request body in bytes (base64 images and JSON); a larger one is refused (HTTP 413).",
    )
    max_image_pixels: int = Field(
        default=4096 * 4096,
        ge=1,
        le=2**31,
        description="Largest image, width x height in pixels, a request may send; a larger one is refused (HTTP "
        "400) before it is decoded.",
    )
    threads: int | None = Field(
        default=None, ge=1, le=1024, description="torch threads of the server's forward pass; None = torch's default."
    )
    check: ClassifierCheckConfig = Field(
        default_factory=ClassifierCheckConfig,
        description="The pipeline's serving check of the classifier: image load test, parity and thresholds.",
    )


def classifier_unservable(classifier: ClassifierServeConfig, tensor_parallel: int) -> list[str]:
    """Why the classifier cannot be served as configured (empty when it can), each as `field=value: problem; fix`."""
    problems = []
    if tensor_parallel > 1:
        problems.append(f"serve.tensor_parallel={tensor_parallel}: the classifier server runs one process on one "
                        "device; use 1 (and serve.replicas for more throughput)")  # fmt: skip
    if classifier.check.images_per_request > classifier.max_batch:
        problems.append(
            f"serve.classifier.check.images_per_request={classifier.check.images_per_request}: more than one forward "
            f"pass takes (serve.classifier.max_batch={classifier.max_batch}); lower it or raise max_batch"
        )
    return problems
