"""The serving check of a vision-language model (model.kind vlm): export the checkpoint as a LLaVA folder, serve it
with vLLM, and measure it with image requests.

Requests are OpenAI chat completions whose one user message holds the image as a PNG data URI (`image_url`); the
exported chat template renders it as `<image>`, which the processor expands into the image's patch tokens, so the
served prompt is the image alone, as in training. Measured:
- greedy parity: the server's greedy caption (temperature 0, EOS ignored) of held-out images against our own
  model's (training/vlm.py on the same uint8 pixels), token by token;
- captioning quality: the server's greedy captions (stopping at EOS) against the dataset's reference captions,
  BLEU-4 and ROUGE-L (validation/serving.py `score_quality`);
- a load test of image requests at serve.check.max_concurrency: P50/P95/P99 end-to-end latency, images/s and
  output tokens/s (a client here: vLLM's `bench serve` sends no images from a custom dataset).
The figures are judged by the same thresholds as a language model's (validation/serving.py `judge`), and the
check writes the files a language model's writes, by the same writer (tasks/serve/report.py `write_reports`):
serving.json, junit.xml, the latency histogram and the serving manifests (vLLM with the LLaVA flags).
"""

from __future__ import annotations

import base64
import io
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tasks.errors import UserError
from tasks.results import StepResult
from tasks.serve.check import Judged, LatencyPlot, decode, p99_threshold, post_json, served_folder
from tasks.serve.report import write_reports
from validation.serving import (
    LatencyFigures,
    LoadFigures,
    ParityFigures,
    QualityFigures,
    ServingCheck,
    compare_greedy,
    judge,
    score_quality,
)

if TYPE_CHECKING:
    import torch

    from tasks.export.readme import AcceptanceFigures
    from tasks.serve.check import ServingCheckConfig
    from tasks.serve.config import ServeConfig
    from tasks.serve.server import Server
    from training.config import TrainConfig
    from training.vlm import VisionLanguageModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldOutImages:
    """Held-out images (uint8 (B, C, H, W)) and their reference captions (token ids up to EOS, and text)."""

    images: torch.Tensor
    captions: list[list[int]]
    split: str


def held_out_images(train: TrainConfig, count: int) -> HeldOutImages:
    """`count` images of the caption dataset's held-out split (the training split when it has none), spread over
    it, with their captions cut at EOS."""
    from training.image_dataset import ImageDataset, read_image_manifest

    url = train.data.dataset_url
    manifest = read_image_manifest(url, train.storage)
    split = train.data.val_split if train.data.val_split in manifest.splits else train.data.train_split
    data = ImageDataset(url, split, train.storage, expect_kind="captions")
    if len(data) == 0:
        raise UserError(f"split {split!r} of {url} holds no image", "prepare the dataset with a validation split")
    stride = max(1, len(data) // count)
    batch = data.batch([(i * stride) % len(data) for i in range(count)])
    captions = []
    for row in batch.targets.tolist():
        end = row.index(manifest.eos_id) if manifest.eos_id in row else len(row)
        captions.append(row[:end])
    return HeldOutImages(batch.images, captions, split)


def data_uri(image: torch.Tensor) -> str:
    """A uint8 (C, H, W) image as a PNG data URI (lossless: the server decodes our exact pixels)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def caption_request(served_name: str, image: torch.Tensor, tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """The chat completion body that asks for a greedy caption of `image`."""
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}}]}
    return {"model": served_name, "messages": [message], "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "return_token_ids": True}  # fmt: skip


def served_captions(
    server: Server, images: torch.Tensor, tokens: int, ignore_eos: bool
) -> tuple[list[list[int]], list[str]]:
    """The server's greedy captions of `images`: their token ids and texts."""
    ids, texts = [], []
    for image in images:
        choice = post_json(f"{server.url}/v1/chat/completions",
                           caption_request(server.served_name, image, tokens, ignore_eos))["choices"][0]  # fmt: skip
        ids.append(list(choice.get("token_ids") or []))
        texts.append((choice.get("message") or {}).get("content") or "")
    return ids, texts


def our_captions(model: VisionLanguageModel, images: torch.Tensor, tokens: int) -> list[list[int]]:
    """Greedy captions of our model: argmax after [image tokens] + the caption so far, `tokens` times, EOS not
    special."""
    import torch

    out = []
    with torch.no_grad():
        for image in images:
            ids = torch.zeros((1, 0), dtype=torch.long)
            for _ in range(tokens):
                logits, _ = model(image[None], ids)
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0].tolist())
    return out


def _percentiles(values_ms: list[float]) -> LatencyFigures:
    import numpy as np

    if not values_ms:
        return LatencyFigures(math.nan, math.nan, math.nan, math.nan)
    p50, p95, p99 = (float(v) for v in np.percentile(values_ms, [50, 95, 99]))
    return LatencyFigures(p50=p50, p95=p95, p99=p99, mean=float(np.mean(values_ms)))


@dataclass(frozen=True)
class ImageLoad:
    """The image load test's figures, images/s and each request's end-to-end latency."""

    figures: LoadFigures
    images_per_s: float
    per_request_ms: list[float]


def image_load_test(server: Server, images: torch.Tensor, check: ServingCheckConfig) -> ImageLoad:
    """check.num_prompts caption requests (the images in turn) at check.max_concurrency in flight; the figures
    (no streaming: time to first token is not measured), images/s and the latencies."""
    bodies = [caption_request(server.served_name, images[i % len(images)], check.output_tokens, True)
              for i in range(check.num_prompts)]  # fmt: skip

    def send(body: dict[str, Any]) -> tuple[float, int] | None:
        started = time.perf_counter()
        try:
            answer = post_json(f"{server.url}/v1/chat/completions", body, timeout_s=check.load_timeout_s)
        except (UserError, OSError) as err:  # counted as a failed request; the server log says why
            log.warning("image load test: a request failed: %s", err)
            return None
        return 1000.0 * (time.perf_counter() - started), int(answer.get("usage", {}).get("completion_tokens", 0))

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=check.max_concurrency) as pool:
        results = list(pool.map(send, bodies))
    duration = time.perf_counter() - started
    done = [r for r in results if r is not None]
    tokens = sum(t for _, t in done)
    not_measured = LatencyFigures(math.nan, math.nan, math.nan, math.nan)
    load = LoadFigures(
        requests=len(bodies), failed=len(bodies) - len(done), duration_s=duration, output_tokens=tokens,
        output_tokens_per_s=tokens / duration, requests_per_s=len(done) / duration, ttft_ms=not_measured,
        itl_ms=not_measured, e2e_ms=_percentiles([ms for ms, _ in done]), max_concurrency=check.max_concurrency,
        request_rate_per_s=None,
    )  # fmt: skip
    return ImageLoad(load, len(done) / duration, [ms for ms, _ in done])


@dataclass(frozen=True)
class CaptioningReport(Judged):
    """Everything the captioning serving check measured and judged (serving.json)."""

    MODEL_KIND: ClassVar[str] = "vlm"

    model_dir: str
    step: int
    url: str
    server_pid: int
    accelerator: str
    model_impl: str
    load: LoadFigures
    images_per_s: float
    parity: ParityFigures
    quality: QualityFigures
    checks: list[ServingCheck]
    predictions: list[str]
    references: list[str]
    files: dict[str, str]
    per_request_ms: list[float] = field(default_factory=list)

    def latency_plot(self) -> LatencyPlot:
        """The image load test's end-to-end latency per caption request, for the histogram."""
        return LatencyPlot(
            self.per_request_ms, self.load.e2e_ms, p99_threshold(self.checks, "p99_e2e_latency_ms"),
            "end-to-end latency per caption request (ms)",
            f"{self.load.requests} image requests, concurrency {self.load.max_concurrency}, "
            f"{self.images_per_s:.1f} images/s",
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """serving.json's content."""
        data = asdict(self)
        data.pop("per_request_ms")
        data["verdict"] = "passed" if self.passed else "failed"
        data["load"]["error_rate"] = self.load.error_rate
        data["parity"]["share"] = self.parity.share
        return data


def measure_captioning(
    server: Server, model_dir: Path, data: HeldOutImages, ours: list[list[int]], check: ServingCheckConfig
) -> tuple[ParityFigures, QualityFigures, ImageLoad, list[str], list[str]]:
    """Greedy parity against `ours`, captioning quality against the references and the image load test."""
    served, _ = served_captions(server, data.images[: check.parity_prompts], check.parity_tokens, ignore_eos=True)
    parity = compare_greedy(ours, served, check.parity_tokens)
    _, predictions = served_captions(server, data.images[: check.quality_prompts], check.output_tokens, False)
    references = decode(model_dir, data.captions[: check.quality_prompts])
    quality = score_quality(predictions, references)
    load = image_load_test(server, data.images, check)
    return parity, quality, load, predictions, references


def run_captioning_check(
    serve: ServeConfig, train: TrainConfig, accelerator: str, name: str, out_dir: Path, export_root: str,
    step: int | None = None, model_dir: str | None = None, pod_memory_bytes: float | None = None,
    acceptance: AcceptanceFigures | None = None,
) -> CaptioningReport:  # fmt: skip
    """Export the newest sound (or the given) checkpoint of a vision-language run as a LLaVA folder (or take
    `model_dir` of checkpoint `step`), serve it, measure it with image requests (greedy parity against our own
    model of that step), stop the server, write the serving check's files into `out_dir`
    (tasks/serve/report.py: serving.json, junit.xml, the latency histogram, the serving manifests, whose pods get
    `pod_memory_bytes`); `acceptance`: the figures the exported folder's model card shows."""
    import torch

    from tasks.serve.server import SERVER_LOG, folder_architecture, model_impl, start_server, with_folder_dtype
    from training.checkpoint import CheckpointManager
    from training.vlm import VisionLanguageModel

    check = serve.check
    assert train.model.vision is not None
    limit = serve.max_model_len or train.model.seq_len
    longest = train.model.vision.num_patches + max(check.output_tokens, check.parity_tokens)
    if longest > limit:
        raise UserError(
            f"serve.check.output_tokens={check.output_tokens}, parity_tokens={check.parity_tokens}: with the image's "
            f"{train.model.vision.num_patches} tokens a request needs {longest}, more than the served context of "
            f"{limit} (serve.max_model_len or model.seq_len)", "lower them",
        )  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    folder, served_step = served_folder(train, step, model_dir, export_root, acceptance, "vLLM serves")
    data = held_out_images(train, max(check.parity_prompts, check.quality_prompts))
    model = VisionLanguageModel(train.model)
    CheckpointManager(train.checkpoint, train.storage).load_model(served_step, model)
    ours = our_captions(model.eval().to(torch.float32), data.images[: check.parity_prompts], check.parity_tokens)
    del model
    server = start_server(folder, serve, name, serve.max_model_len or train.model.seq_len, out_dir / SERVER_LOG,
                          accelerator)  # fmt: skip
    try:
        parity, quality, load, predictions, references = measure_captioning(
            server, folder, data, ours, check
        )
    finally:
        server.stop()
    report = CaptioningReport(
        model_dir=str(folder), step=served_step, url=server.url, server_pid=server.pid, accelerator=accelerator,
        model_impl=model_impl(serve, folder_architecture(folder), accelerator), load=load.figures,
        images_per_s=load.images_per_s, parity=parity, quality=quality,
        checks=judge(load.figures, parity, quality, check.thresholds), predictions=predictions,
        references=references, files={"server_log": str(out_dir / SERVER_LOG)}, per_request_ms=load.per_request_ms,
    )  # fmt: skip
    return write_reports(report, with_folder_dtype(serve, folder), name, out_dir, pod_memory_bytes)


class CaptioningServingResult(StepResult):
    """The vision-language serving check: the served checkpoint, its latency, throughput, parity and captioning
    quality."""

    verdict_text: str
    step: int
    model_dir: str
    model_impl: str
    p99_e2e_ms: float
    images_per_s: float
    output_tokens_per_s: float
    error_rate: float
    greedy_matched: int
    greedy_prompts: int
    rouge_l: float
    bleu4: float
    files: dict[str, str]
    failed: list[str] = []

    @classmethod
    def of(cls, report: CaptioningReport) -> CaptioningServingResult:
        """The step's small result from the full report."""
        return cls(
            verdict_text="passed" if report.passed else "failed", step=report.step, model_dir=report.model_dir,
            model_impl=report.model_impl, p99_e2e_ms=report.load.e2e_ms.p99, images_per_s=report.images_per_s,
            output_tokens_per_s=report.load.output_tokens_per_s, error_rate=report.load.error_rate,
            greedy_matched=report.parity.matched, greedy_prompts=report.parity.prompts,
            rouge_l=report.quality.rouge_l, bleu4=report.quality.bleu4, files=report.files, failed=report.failed,
        )  # fmt: skip

    def summary(self) -> str:
        """Verdict, P99 latency, images/s, errors, parity, captioning quality and where serving.json is."""
        return (
            f"{self.verdict_text}: step {self.step} (vLLM --model-impl {self.model_impl}); P99 e2e "
            f"{self.p99_e2e_ms:.1f} ms per caption; {self.images_per_s:.1f} images/s; errors {self.error_rate:.1%}; "
            f"greedy parity {self.greedy_matched}/{self.greedy_prompts} images; ROUGE-L F1 {self.rouge_l:.3f} (0-1), "
            f"BLEU-4 {self.bleu4:.2f} (0-100); `{self.files.get('json', '-')}`"
        )
