"""An HTTP server for an exported Hugging Face image classifier (ViTForImageClassification), with dynamic batching.

vLLM serves no image classification, so the classifier is served by transformers behind this small server:
POST /v1/classify (JSON {"images": [base64 PNG or JPEG, ...], "top_k": 1} -> a label and score per image),
GET /health and GET /metrics (Prometheus text). Requests that arrive within --max-wait-ms of the first waiting
one run as one forward pass of at most --max-batch images.

The metrics keep the names of vLLM's OpenAI-compatible server (vllm:e2e_request_latency_seconds,
vllm:request_success_total, vllm:num_requests_running/_waiting, http_requests_total) so that the serving alerts
and dashboard under deployments/monitoring read a classifier as they read a language model; the batch sizes are
the classifier's own (tdeploy:classifier_batch_images).

A standalone program: it imports only what the serving image has (torch, transformers, Pillow, starlette,
uvicorn, prometheus_client), none of this repository, and runs as `python classifier_server.py --model DIR ...`.
Input is untrusted: a body over --max-request-bytes is refused (413), an image that is not base64, not a PNG or
JPEG, cannot be decoded or has more than --max-image-pixels is refused (400) with a message naming the image and
the limit; a traceback goes to the log, never to the client.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import json
import logging
import time
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("classifier_server")

FORMATS = ("PNG", "JPEG")
"""Image formats the server decodes (Pillow plugin names); anything else is refused before decoding."""
DEFAULT_LATENCY_BUCKETS_S = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0)


class BadRequest(Exception):
    """A request the server refuses: its HTTP status and a message naming what is wrong and the fix."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def decode_image(data: object, index: int, max_pixels: int) -> Any:
    """One request image (base64 of a PNG or JPEG) as an RGB PIL image; BadRequest naming `images[index]` when
    it is not base64, not a PNG or JPEG, larger than `max_pixels` or cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    where = f"images[{index}]"
    if not isinstance(data, str):
        raise BadRequest(f"{where}: expected a base64 string of a PNG or JPEG file, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise BadRequest(f"{where}: not valid base64 ({err}); send the file's bytes base64-encoded") from err
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise BadRequest(f"{where}: image too large ({err}); --max-image-pixels={max_pixels}: resize it before "
                         "sending") from err  # fmt: skip
    except UnidentifiedImageError as err:
        raise BadRequest(f"{where}: not a PNG or JPEG image (Pillow cannot identify it); send a PNG or JPEG") from err
    except (OSError, ValueError, SyntaxError) as err:  # Pillow's plugins raise these on a corrupt header
        raise BadRequest(f"{where}: not a PNG or JPEG image that can be read ({err}); send a PNG or JPEG") from err
    width, height = image.size
    if width * height > max_pixels:
        raise BadRequest(
            f"{where}: image too large, {width}x{height} = {width * height} pixels > --max-image-pixels={max_pixels}; "
            "resize it before sending"
        )
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise BadRequest(f"{where}: the {image.format} image cannot be decoded ({err}); send an intact file") from err


def parse_request(body: bytes, max_images: int, num_labels: int) -> tuple[list[Any], int]:
    """The request's images (still base64) and top_k from a JSON body; BadRequest when it is malformed."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not JSON ({err}); send {{\"images\": [<base64 PNG or JPEG>, ...]}}") from err
    if not isinstance(request, dict) or not isinstance(request.get("images"), list):
        raise BadRequest('the body must be a JSON object with "images": a list of base64 PNG or JPEG files')
    images = request["images"]
    if not 1 <= len(images) <= max_images:
        raise BadRequest(f"images: {len(images)} given; send 1 to {max_images} (--max-batch) per request")
    extra = set(request) - {"images", "top_k", "model"}
    if extra:
        raise BadRequest(f"unknown fields {sorted(extra)}; the body takes images, top_k and model")
    top_k = request.get("top_k", 1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_labels:
        raise BadRequest(f"top_k={top_k!r}: must be an integer from 1 to the model's {num_labels} labels")
    return images, top_k


@dataclass
class _Job:
    items: Any
    size: int
    future: asyncio.Future
    arrived_s: float


@dataclass
class Batcher:
    """Dynamic batching: jobs that arrive within `max_wait_s` of the first waiting one run as one call of
    `run_batch` on at most `max_batch` items (a job that would overflow the batch waits for the next).

    `run_batch(list of jobs' items) -> list of per-job results` runs in one worker thread, so the event loop keeps
    taking requests while a batch runs; `on_batch(batch size, jobs)` hears of every batch."""

    run_batch: Callable[[list[Any]], list[Any]]
    max_batch: int
    max_wait_s: float
    on_batch: Callable[[int, int], None] | None = None
    _pending: deque[_Job] = field(default_factory=deque)
    _wakeup: asyncio.Event | None = None
    _task: asyncio.Task | None = None
    _executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "batch"))

    @property
    def waiting(self) -> int:
        """Jobs queued for a batch."""
        return len(self._pending)

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop; waiting jobs fail."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in self._pending:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is stopping"))
        self._pending.clear()
        self._executor.shutdown(wait=False)

    async def submit(self, items: Any, size: int) -> Any:
        """Queue one job of `size` items (1..max_batch); its result once its batch has run."""
        assert 1 <= size <= self.max_batch and self._wakeup is not None, "sizes are checked by the caller"
        loop = asyncio.get_running_loop()
        job = _Job(items, size, loop.create_future(), loop.time())
        self._pending.append(job)
        self._wakeup.set()
        return await job.future

    def _take(self, now: float) -> tuple[list[_Job], bool]:
        """Jobs that fit one batch from the queue's head, and whether the batch is closed (full, or the first
        job's wait is over)."""
        batch, size = [], 0
        for job in self._pending:
            if size + job.size > self.max_batch:
                return batch, True
            batch.append(job)
            size += job.size
        full = size >= self.max_batch
        return batch, full or (bool(batch) and now >= batch[0].arrived_s + self.max_wait_s)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch, closed = self._take(loop.time())
            if not closed:
                self._wakeup.clear()
                remaining = self._pending[0].arrived_s + self.max_wait_s - loop.time()
                try:  # a new job may fill the batch before the wait is over
                    await asyncio.wait_for(self._wakeup.wait(), timeout=max(remaining, 0.0))
                except TimeoutError:
                    pass
                continue
            for _ in batch:
                self._pending.popleft()
            size = sum(job.size for job in batch)
            if self.on_batch is not None:
                self.on_batch(size, len(batch))
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, [job.items for job in batch])
            except Exception as err:  # noqa: BLE001 - every job of the batch hears of the failure
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(err)
                continue
            for job, result in zip(batch, results, strict=True):
                if not job.future.done():
                    job.future.set_result(result)


class Classifier:
    """The model and its image processor from a Hugging Face folder: images -> top-k labels and scores."""

    def __init__(self, model_dir: str, dtype: str | None, threads: int | None) -> None:
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        self.model = AutoModelForImageClassification.from_pretrained(model_dir, **kwargs).eval()
        self.labels = {int(k): str(v) for k, v in self.model.config.id2label.items()}
        self.num_labels = int(self.model.config.num_labels)

    def pixels(self, images: Sequence[Any]) -> Any:
        """The processor's pixel values of RGB images (N, 3, H, W)."""
        return self.processor(images=list(images), return_tensors="pt")["pixel_values"]

    def probabilities(self, pixel_batches: list[Any]) -> list[Any]:
        """One forward pass over the concatenated pixel values; softmax probabilities split back per batch."""
        torch = self.torch
        pixels = torch.cat(pixel_batches).to(self.model.dtype)
        with torch.inference_mode():
            probs = torch.softmax(self.model(pixel_values=pixels).logits.float(), dim=-1)
        return list(probs.split([len(p) for p in pixel_batches]))

    def answer(self, probs: Any, top_k: int) -> list[dict[str, Any]]:
        """Per image: the top label, its id and probability, and the top_k of them."""
        scores, ids = probs.topk(top_k, dim=-1)
        out = []
        for row_scores, row_ids in zip(scores.tolist(), ids.tolist(), strict=True):
            ranked = [
                {"label": self.labels.get(i, str(i)), "label_id": i, "score": s}
                for s, i in zip(row_scores, row_ids, strict=True)
            ]
            out.append({**ranked[0], "top_k": ranked})
        return out


class Metrics:
    """The server's Prometheus metrics in a registry of its own."""

    def __init__(self, model_name: str, latency_buckets_s: Sequence[float], max_batch: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency from arrival to answer, in seconds.", labels,
            buckets=list(latency_buckets_s), registry=self.registry,
        )  # fmt: skip
        self.success = Counter("vllm:request_success", "Requests answered.", [*labels, "finished_reason"],
                               registry=self.registry)  # fmt: skip
        self.running = Gauge("vllm:num_requests_running", "Requests in the batch that runs.", labels,
                             registry=self.registry)  # fmt: skip
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for a batch.", labels,
                             registry=self.registry)  # fmt: skip
        self.http = Counter("http_requests", "HTTP answers by handler, method and status class.",
                            ["handler", "method", "status"], registry=self.registry)  # fmt: skip
        self.images = Counter("tdeploy:classifier_images", "Images classified.", labels, registry=self.registry)
        buckets = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_batch})
        self.batch = Histogram("tdeploy:classifier_batch_images", "Images per forward pass (dynamic batching).",
                               labels, buckets=[b for b in buckets if b <= max_batch], registry=self.registry)  # fmt: skip
        self.model_name = model_name

    def text(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class Settings:
    """The server's command-line settings."""

    model: str
    served_model_name: str
    host: str
    port: int
    max_batch: int
    max_wait_ms: float
    max_request_bytes: int
    max_image_pixels: int
    dtype: str | None
    threads: int | None
    latency_buckets_s: tuple[float, ...]


async def read_body(receive: Callable[[], Awaitable[dict[str, Any]]], headers: dict[str, str], limit: int) -> bytes:
    """The request body, refused (413) once it passes `limit` bytes (by Content-Length or as it streams)."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body has {declared} bytes > --max-request-bytes={limit}; send fewer or smaller "
                         "images per request", status=413)  # fmt: skip
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client disconnected", status=499)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the body passed --max-request-bytes={limit} bytes; send fewer or smaller images per "
                             "request", status=413)  # fmt: skip
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def build_app(settings: Settings, classifier: Classifier) -> Any:
    """The Starlette app: /v1/classify, /health, /metrics."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    metrics = Metrics(settings.served_model_name, settings.latency_buckets_s, settings.max_batch)
    name = settings.served_model_name

    def on_batch(images: int, requests: int) -> None:
        metrics.batch.labels(name).observe(images)
        metrics.running.labels(name).set(requests)
        metrics.waiting.labels(name).set(batcher.waiting)

    def run_batch(pixel_batches: list[Any]) -> list[Any]:
        try:
            return classifier.probabilities(pixel_batches)
        finally:
            metrics.running.labels(name).set(0)

    batcher = Batcher(run_batch, settings.max_batch, settings.max_wait_ms / 1000.0, on_batch)

    def prepare(body: bytes) -> tuple[Any, int, int]:
        encoded, top_k = parse_request(body, settings.max_batch, classifier.num_labels)
        images = [decode_image(data, i, settings.max_image_pixels) for i, data in enumerate(encoded)]
        return classifier.pixels(images), len(images), top_k

    def status_class(code: int) -> str:
        return f"{code // 100}xx"

    async def classify(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await read_body(request.receive, dict(request.headers), settings.max_request_bytes)
            pixels, count, top_k = await run_in_threadpool(prepare, body)
            metrics.waiting.labels(name).set(batcher.waiting + 1)
            probs = await batcher.submit(pixels, count)
            predictions = classifier.answer(probs, top_k)
        except BadRequest as err:
            metrics.http.labels("/v1/classify", "POST", status_class(err.status)).inc()
            return JSONResponse({"error": err.message}, status_code=err.status)
        except Exception:  # a server fault: the log has the traceback, the client a short message
            log.exception("classify failed")
            metrics.http.labels("/v1/classify", "POST", "5xx").inc()
            return JSONResponse({"error": "internal server error; see the server log"}, status_code=500)
        metrics.latency.labels(name).observe(time.perf_counter() - started)
        metrics.success.labels(name, "stop").inc()
        metrics.images.labels(name).inc(count)
        metrics.http.labels("/v1/classify", "POST", "2xx").inc()
        return JSONResponse({"model": name, "predictions": predictions})

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def metrics_text(request: Request) -> Response:
        body, content_type = metrics.text()
        return Response(body, media_type=content_type)

    async def lifespan(app: Any) -> Any:
        batcher.start()
        yield
        await batcher.stop()

    from contextlib import asynccontextmanager

    routes = [
        Route("/v1/classify", classify, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=asynccontextmanager(lifespan))


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """The command line as Settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config.json, weights, "
                        "preprocessor_config.json)")  # fmt: skip
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=16, help="most images in one forward pass")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="longest wait for a batch to fill")
    parser.add_argument("--max-request-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--max-image-pixels", type=int, default=4096 * 4096)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--latency-buckets-s", default=json.dumps(DEFAULT_LATENCY_BUCKETS_S),
                        help="JSON list of the latency histogram's bucket bounds in seconds")  # fmt: skip
    args = parser.parse_args(argv)
    if args.max_batch < 1 or args.max_wait_ms < 0 or args.max_request_bytes < 1 or args.max_image_pixels < 1:
        parser.error("--max-batch, --max-request-bytes and --max-image-pixels must be >= 1, --max-wait-ms >= 0")
    return Settings(
        model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_request_bytes=args.max_request_bytes,
        max_image_pixels=args.max_image_pixels, dtype=args.dtype, threads=args.threads,
        latency_buckets_s=tuple(float(b) for b in json.loads(args.latency_buckets_s)),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """Load the model, then serve until SIGINT or SIGTERM (uvicorn's graceful shutdown)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_args(argv)
    started = time.monotonic()
    classifier = Classifier(settings.model, settings.dtype, settings.threads)
    log.info("loaded %s (%d labels) in %.1f s; max_batch=%d max_wait_ms=%g", settings.model, classifier.num_labels,
             time.monotonic() - started, settings.max_batch, settings.max_wait_ms)  # fmt: skip
    uvicorn.run(build_app(settings, classifier), host=settings.host, port=settings.port, log_level="info",
                access_log=False)  # fmt: skip


if __name__ == "__main__":
    main()
