"""The classifier server's dynamic batching and input checks, and the serving check's metrics and verdicts."""

from __future__ import annotations

import asyncio
import base64
import io
import math

import numpy as np
import pytest
from PIL import Image

from tasks.serve.classifier import percentiles
from tasks.serve.classifier_config import ClassifierCheckConfig, ClassifierServeConfig, classifier_unservable
from tasks.serve.classifier_server import Batcher, BadRequest, decode_image, parse_request
from training.classification import accuracy, macro_f1
from validation.classifier_serving import (
    ClassifierThresholds,
    ImageLoadFigures,
    classification_figures,
    compare_predictions,
    judge_classifier,
)


def _b64(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def _noise(side: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))


def _png_bytes(image: Image.Image) -> bytes:
    return base64.b64decode(_b64(image))


def _run_jobs(batcher: Batcher, jobs: list[tuple[float, list[int]]]) -> list[object]:
    """Submit each job (delay in s after start, items) and gather the results in job order."""

    async def main() -> list[object]:
        batcher.start()
        try:

            async def one(delay: float, items: list[int]) -> object:
                await asyncio.sleep(delay)
                return await batcher.submit(items, len(items))

            return await asyncio.gather(*(one(d, items) for d, items in jobs))
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_requests_within_the_wait_run_as_one_batch_and_each_gets_its_own_rows() -> None:
    batches: list[list[list[int]]] = []

    def run_batch(items: list[list[int]]) -> list[list[int]]:
        batches.append(items)
        return [[10 * x for x in job] for job in items]

    batcher = Batcher(run_batch, max_batch=8, max_wait_s=0.5)
    results = _run_jobs(batcher, [(0.0, [1]), (0.01, [2, 3]), (0.02, [4])])
    assert results == [[10], [20, 30], [40]]
    assert batches == [[[1], [2, 3], [4]]]


def test_a_batch_never_exceeds_max_batch_and_the_overflowing_request_runs_next() -> None:
    sizes: list[int] = []

    def run_batch(items: list[list[int]]) -> list[int]:
        sizes.append(sum(len(job) for job in items))
        return [sum(job) for job in items]

    batcher = Batcher(run_batch, max_batch=4, max_wait_s=0.5)
    results = _run_jobs(batcher, [(0.0, [1, 1]), (0.01, [2]), (0.02, [3, 3]), (0.03, [4])])
    assert results == [2, 2, 6, 4]
    assert sizes == [3, 3], "the first batch closes when [3, 3] would overflow it; the rest run together"
    assert max(sizes) <= 4


def test_a_full_batch_runs_without_waiting_and_a_lone_request_waits_at_most_max_wait() -> None:
    def run_batch(items: list[list[int]]) -> list[int]:
        return [len(job) for job in items]

    async def timed(max_wait_s: float, size: int) -> float:
        batcher = Batcher(run_batch, max_batch=4, max_wait_s=max_wait_s)
        batcher.start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await batcher.submit(list(range(size)), size)
        await batcher.stop()
        return loop.time() - started

    assert asyncio.run(timed(5.0, 4)) < 2.0, "a full batch must not wait for max_wait_s"
    lone = asyncio.run(timed(0.2, 1))
    assert 0.15 <= lone < 2.0


def test_a_failing_batch_fails_every_request_in_it() -> None:
    def run_batch(items: list[list[int]]) -> list[int]:
        raise RuntimeError("out of memory")

    async def main() -> list[object]:
        batcher = Batcher(run_batch, max_batch=8, max_wait_s=0.05)
        batcher.start()
        got = await asyncio.gather(batcher.submit([1], 1), batcher.submit([2], 1), return_exceptions=True)
        await batcher.stop()
        return got

    got = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "out of memory" in str(e) for e in got)


def test_decode_accepts_png_and_jpeg_as_rgb() -> None:
    image = Image.new("L", (8, 6), color=128)
    for fmt in ("PNG", "JPEG"):
        decoded = decode_image(_b64(image, fmt), 0, 1000)
        assert decoded.mode == "RGB" and decoded.size == (8, 6)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("@@not-base64@@", "not valid base64"),
        (base64.b64encode(b"hello, not an image").decode(), "not a PNG or JPEG"),
        (_b64(Image.new("RGB", (4, 4)), "GIF"), "not a PNG or JPEG"),
        (_b64(Image.new("RGB", (40, 30))), "too large"),
        (base64.b64encode(_png_bytes(_noise(32))[:200]).decode(), "cannot be decoded"),
        (17, "expected a base64 string"),
    ],
    ids=["not-base64", "not-an-image", "gif", "too-many-pixels", "truncated-png", "not-a-string"],
)
def test_bad_images_are_refused_naming_the_image_and_the_problem(data: object, words: str) -> None:
    with pytest.raises(BadRequest) as err:
        decode_image(data, 3, max_pixels=32 * 32)
    assert err.value.status == 400
    assert "images[3]" in err.value.message and words in err.value.message


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "not JSON"),
        (b'{"image": "x"}', '"images"'),
        (b'{"images": []}', "send 1 to 4"),
        (b'{"images": ["a", "b", "c", "d", "e"]}', "send 1 to 4"),
        (b'{"images": ["a"], "top_k": 0}', "top_k=0"),
        (b'{"images": ["a"], "top_k": 6}', "top_k=6"),
        (b'{"images": ["a"], "extra": 1}', "unknown fields"),
    ],
)
def test_malformed_requests_are_refused_with_the_fix(body: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_request(body, max_images=4, num_labels=5)
    assert words in err.value.message


def test_accuracy_and_macro_f1_follow_their_definitions() -> None:
    targets = [0, 0, 0, 1, 1, 2]
    predicted = [0, 0, 1, 1, 2, 2]
    # class 0: TP 2, FP 0, FN 1 -> F1 4/5; class 1: TP 1, FP 1, FN 1 -> 1/2; class 2: TP 1, FP 1, FN 0 -> 2/3
    assert accuracy(predicted, targets) == pytest.approx(4 / 6)
    assert macro_f1(predicted, targets, num_classes=4) == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)
    assert macro_f1(targets, targets, num_classes=3) == 1.0
    figures = classification_figures(predicted, targets, 4, "val")
    assert (figures.images, figures.accuracy) == (6, pytest.approx(4 / 6))


def test_metrics_refuse_mismatched_lengths_and_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="2 predictions for 3 targets"):
        accuracy([0, 1], [0, 1, 1])
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        macro_f1([0, 2], [0, 1], num_classes=2)


def test_parity_counts_top1_matches_and_the_largest_score_difference() -> None:
    local = [(0, 0.9), (1, 0.6), (2, 0.5)]
    served = [(0, 0.9000004), (1, 0.6), (0, 0.51)]
    parity = compare_predictions(local, served)
    assert (parity.images, parity.top1_matched) == (3, 2)
    assert parity.top1_match == pytest.approx(2 / 3)
    assert parity.score_max_abs_diff == pytest.approx(0.01)
    assert parity.mismatches == [{"image": 2, "local": [2, 0.5], "served": [0, 0.51]}]


def _load(p99_ms: float, failed: int = 0) -> ImageLoadFigures:
    latency = percentiles([p99_ms] * 4)
    return ImageLoadFigures(requests=4, failed=failed, images=4 - failed, duration_s=1.0, images_per_s=4.0 - failed,
                            requests_per_s=4.0, latency_ms=latency, max_concurrency=2, images_per_request=1)  # fmt: skip


def test_each_threshold_fails_its_own_figure() -> None:
    quality = classification_figures([0, 1, 1, 1], [0, 1, 0, 0], 2, "val")  # accuracy 1/2
    parity = compare_predictions([(0, 0.5)] * 4, [(0, 0.5), (0, 0.5), (1, 0.5), (0, 0.7)])
    thresholds = ClassifierThresholds(p99_latency_ms_max=100, accuracy_min=0.75, macro_f1_min=0.1,
                                      images_per_s_min=1.0, top1_match_min=1.0, score_abs_diff_max=1e-3)  # fmt: skip
    checks = {c.name: c for c in judge_classifier(_load(250.0, failed=1), quality, parity, thresholds)}
    failed = {name for name, c in checks.items() if c.passed is False}
    assert failed == {"p99_latency_ms", "error_rate", "accuracy", "top1_match", "score_abs_diff"}
    assert checks["macro_f1"].passed and checks["images_per_s"].passed
    assert "250" in checks["p99_latency_ms"].message and "serve.classifier" in checks["p99_latency_ms"].message
    good = judge_classifier(_load(50.0), classification_figures([0, 1], [0, 1], 2, "val"),
                            compare_predictions([(1, 0.5)], [(1, 0.5)]), thresholds)  # fmt: skip
    assert all(c.passed is not False for c in good)


def test_percentiles_interpolate_and_an_empty_load_is_not_measured() -> None:
    figures = percentiles([float(x) for x in range(1, 101)])
    assert figures.p50 == pytest.approx(50.5) and figures.p99 == pytest.approx(99.01)
    assert math.isnan(percentiles([]).p99)
    assert np.isclose(figures.mean, 50.5)


def test_a_classifier_is_served_by_one_process_with_requests_that_fit_a_batch() -> None:
    config = ClassifierServeConfig(max_batch=4, check=ClassifierCheckConfig(images_per_request=8))
    problems = classifier_unservable(config, tensor_parallel=2)
    assert any(p.startswith("serve.tensor_parallel=2:") for p in problems)
    assert any(p.startswith("serve.classifier.check.images_per_request=8:") for p in problems)
    assert classifier_unservable(ClassifierServeConfig(), 1) == []
