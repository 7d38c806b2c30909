"""Serving acceptance of an image classifier as plain functions: latency, images/s, errors, classification
quality (accuracy, macro F1) and parity of the served answers with transformers' own predictions.

The measurements come from the image load test (tasks/serve/classifier.py) and the server's Prometheus metrics;
this module only computes the metrics from answers and labels and judges them against `ClassifierThresholds`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from training.config import StrictModel
from validation.serving import LatencyFigures, ServingCheck, gate


class ClassifierThresholds(StrictModel):
    """Pass thresholds of the classifier's serving check (`serve.classifier.check.thresholds`)."""

    p99_latency_ms_max: float = Field(
        default=150.0,
        gt=0,
        description="Largest P99 latency of one classify request (serve.classifier.check.images_per_request "
        "images), arrival to answer as the client sees it, in ms. The guide's GPU target is 150 ms; a CPU "
        "deployment sets a looser value that still fails on a collapse.",
    )
    error_rate_max: float = Field(
        default=0.0, ge=0, le=1, description="Largest share of load-test requests that failed (0 = none may fail)."
    )
    images_per_s_min: float | None = Field(
        default=None, gt=0, description="Smallest images classified per second in the load test; None = not gated."
    )
    accuracy_min: float = Field(
        default=0.0, ge=0, le=1, description="Smallest accuracy (0-1) of the served top-1 labels on held-out images."
    )
    macro_f1_min: float = Field(
        default=0.0, ge=0, le=1, description="Smallest macro F1 (0-1) of the served top-1 labels on held-out images."
    )
    top1_match_min: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Smallest share of images whose served top-1 label equals transformers' own prediction on the "
        "same image (the exported folder loaded in this process).",
    )
    score_abs_diff_max: float = Field(
        default=1e-5,
        gt=0,
        le=1,
        description="Largest |served - local| top-1 probability over the images. In float32 batches of different "
        "sizes differ by rounding only (measured 3e-8 on CPU, served batch 1 against local batch 32); a model "
        "served in bfloat16 or float16 needs about 1e-2.",
    )


@dataclass(frozen=True)
class ImageLoadFigures:
    """What the image load test measured."""

    requests: int
    failed: int
    images: int
    """Images in the requests that completed."""
    duration_s: float
    images_per_s: float
    requests_per_s: float
    latency_ms: LatencyFigures
    max_concurrency: int
    images_per_request: int
    errors: list[str] = field(default_factory=list)
    """The first distinct failure messages (at most a few)."""

    @property
    def error_rate(self) -> float:
        """Failed requests over all sent."""
        return self.failed / self.requests if self.requests else 1.0

    @property
    def completed(self) -> int:
        """Requests that completed (the latencies are theirs)."""
        return self.requests - self.failed


@dataclass(frozen=True)
class ClassificationFigures:
    """The served top-1 labels against the held-out labels."""

    images: int
    accuracy: float
    macro_f1: float
    num_classes: int
    split: str


def classification_figures(predicted: list[int], labels: list[int], num_classes: int,
                           split: str) -> ClassificationFigures:  # fmt: skip
    """Accuracy and macro F1 (training/classification.py) of `predicted` against `labels`."""
    from training.classification import accuracy, macro_f1  # torch: the serving thresholds in the spec need none

    return ClassificationFigures(
        images=len(labels), accuracy=accuracy(predicted, labels), macro_f1=macro_f1(predicted, labels, num_classes),
        num_classes=num_classes, split=split,
    )  # fmt: skip


@dataclass(frozen=True)
class ClassifierParityFigures:
    """The served top-1 labels and probabilities against transformers' own on the same images."""

    images: int
    top1_matched: int
    score_max_abs_diff: float
    score_mean_abs_diff: float
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    """The first images whose top-1 label differs: index, ours (label, score), the server's."""

    @property
    def top1_match(self) -> float:
        """Matching images over all."""
        return self.top1_matched / self.images if self.images else 0.0


def compare_predictions(local: list[tuple[int, float]], served: list[tuple[int, float]],
                        keep: int = 8) -> ClassifierParityFigures:  # fmt: skip
    """Per image (label id, top-1 probability) of transformers' local forward against the server's answers."""
    matched, diffs, mismatches = 0, [], []
    for i, ((ours_id, ours_p), (their_id, their_p)) in enumerate(zip(local, served, strict=True)):
        diffs.append(abs(ours_p - their_p))
        if ours_id == their_id:
            matched += 1
        elif len(mismatches) < keep:
            mismatches.append({"image": i, "local": [ours_id, ours_p], "served": [their_id, their_p]})
    return ClassifierParityFigures(
        images=len(local), top1_matched=matched, score_max_abs_diff=max(diffs, default=math.nan),
        score_mean_abs_diff=sum(diffs) / len(diffs) if diffs else math.nan, mismatches=mismatches,
    )  # fmt: skip


def judge_classifier(
    load: ImageLoadFigures,
    quality: ClassificationFigures,
    parity: ClassifierParityFigures,
    thresholds: ClassifierThresholds,
) -> list[ServingCheck]:
    """Every gated figure against its threshold, as one table (what, value, limit, upper or lower bound, fix)."""
    none_completed = (
        f"none of the load test's {load.requests} requests completed, so no latency was measured: the errors in "
        "serving.json and the server log say why"
    )
    table: list[tuple[str, float | None, float | None, bool, str]] = [
        ("p99_latency_ms", load.latency_ms.p99, thresholds.p99_latency_ms_max, True,
         none_completed if load.completed <= 0 else "raise serve.classifier.max_batch or lower "
         "serve.classifier.max_wait_ms, add replicas, or lower serve.classifier.check.max_concurrency"),
        ("error_rate", load.error_rate, thresholds.error_rate_max, True,
         "serving.json's load.errors and the server log say why requests failed"),
        ("images_per_s", load.images_per_s, thresholds.images_per_s_min, False,
         "compare with benchmarks/vision.py on this hardware; raise serve.classifier.max_batch"),
        ("accuracy", quality.accuracy, thresholds.accuracy_min, False,
         "the served classifier is less accurate than the spec asks: train longer or check the data"),
        ("macro_f1", quality.macro_f1, thresholds.macro_f1_min, False,
         "some classes are predicted poorly: check the class balance of the data, train longer"),
        ("top1_match", parity.top1_match, thresholds.top1_match_min, False,
         "the server answers differently from the exported folder loaded with transformers: check the server's "
         "dtype and its image processor; serving.json lists the first differing images"),
        ("score_abs_diff", parity.score_max_abs_diff, thresholds.score_abs_diff_max, True,
         "the served probabilities differ from transformers' own: check the served dtype (serve.dtype)"),
    ]  # fmt: skip
    return [gate(*row) for row in table]
