"""The serving step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tasks.errors import UserError
from tasks.export.readme import AcceptanceFigures
from tasks.paths import DeploymentPaths
from tasks.results import StepResult
from tasks.serve.captioning import CaptioningReport, CaptioningServingResult, run_captioning_check
from tasks.serve.check import ServingReport, run_serving_check
from tasks.serve.classifier import ClassifierReport, ClassifierServingResult, run_classifier_check, start_classifier
from tasks.serve.config import ServeConfig
from tasks.serve.server import Server, start_server
from training.config import ModelConfig, TrainConfig

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

TITLE = "serving check"
ARTIFACT = "serving"
CHAIN_ARTIFACT = "serving-parity-chain"


class ServingCheckFailed(UserError):
    """A served figure missed its threshold; serving.json says which and what to look at."""


class ServingInputs(BaseModel):
    """What the serving check reads: the serve section, the training config whose checkpoint is served, the
    accelerator, the served model's name, the report folder and the export root."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    serve: ServeConfig
    train: TrainConfig
    accelerator: str
    name: str
    out_dir: str
    """serving.json, the server's log and the manifests (tasks.paths: <reports>/serving)."""
    export_root: str
    """The folder the served checkpoint is exported under (tasks.paths: <reports>/export)."""
    step: int | None = None
    """The checkpoint step to export and serve (None: the newest sound one)."""
    model_dir: str | None = None
    """A finished model folder of checkpoint `step` to serve instead of exporting (the quantize step's)."""
    quantization_json: str | None = None
    """The quantize step's gate report of `model_dir`: the parity chain's quantized hop."""
    acceptance: AcceptanceFigures | None = None
    """The acceptance figures the exported folder's model card shows (the deployment's latest)."""
    pod_memory_bytes: float | None = None
    """One server pod's memory by the capacity step's serving plan: the serving manifests' memory request and
    limit (with headroom) unless serve.memory_per_replica_gb sets it (None: only that)."""

    @classmethod
    def of(
        cls,
        spec: DeploymentSpec,
        train: TrainConfig,
        folder: str | None = None,
        step: int | None = None,
        model_dir: str | None = None,
        quantization_json: str | None = None,
        acceptance: AcceptanceFigures | None = None,
        pod_memory_bytes: float | None = None,
    ) -> ServingInputs:
        """The serving check of `spec` (`train`: data_and_training's), its reports in `folder` (default
        <reports>/serving); `model_dir` (with its `step`): serve that folder, the quantize step's, instead of
        the export; serve: null is the caller's case."""
        assert spec.serve is not None, "callers handle serve: null"
        paths = DeploymentPaths.of(spec)
        return cls(
            serve=spec.serve, train=train, accelerator=spec.cluster.accelerator, name=spec.name,
            out_dir=paths.serving_dir(folder), export_root=paths.export_dir, step=step, model_dir=model_dir,
            quantization_json=quantization_json, acceptance=acceptance, pod_memory_bytes=pod_memory_bytes,
        )  # fmt: skip


class ServingResult(StepResult):
    """The serving check: the served checkpoint, its latency, throughput, parity and quality figures."""

    verdict_text: str
    step: int
    model_dir: str
    p99_e2e_ms: float
    p99_ttft_ms: float
    output_tokens_per_s: float
    error_rate: float
    greedy_matched: int
    greedy_prompts: int
    rouge_l: float
    bleu4: float
    files: dict[str, str]
    failed: list[str] = []

    @classmethod
    def of(cls, report: ServingReport) -> ServingResult:
        """The step's small result from the full report."""
        return cls(
            verdict_text="passed" if report.passed else "failed",
            step=report.step,
            model_dir=report.model_dir,
            p99_e2e_ms=report.load.e2e_ms.p99,
            p99_ttft_ms=report.load.ttft_ms.p99,
            output_tokens_per_s=report.load.output_tokens_per_s,
            error_rate=report.load.error_rate,
            greedy_matched=report.parity.matched,
            greedy_prompts=report.parity.prompts,
            rouge_l=report.quality.rouge_l,
            bleu4=report.quality.bleu4,
            files=report.files,
            failed=report.failed,
        )

    def summary(self) -> str:
        """Verdict, P99 latencies, throughput, errors, parity and quality, and where serving.json is."""
        return (
            f"{self.verdict_text}: step {self.step}; P99 e2e {self.p99_e2e_ms:.1f} ms, TTFT {self.p99_ttft_ms:.1f} ms; "
            f"{self.output_tokens_per_s:.0f} output tokens/s; errors {self.error_rate:.1%}; greedy parity "
            f"{self.greedy_matched}/{self.greedy_prompts}; ROUGE-L F1 {self.rouge_l:.3f} (0-1), "
            f"BLEU-4 {self.bleu4:.2f} (0-100); `{self.files.get('json', '-')}`"
        )


@dataclass(frozen=True)
class ServedKind:
    """How a model.kind is served: by which server, and the endpoint its clients ask."""

    server: str
    endpoint: str
    endpoint_path: str


SERVED_KINDS = {
    "lm": ServedKind("the vLLM server", "completions", "/v1/completions"),
    "vlm": ServedKind("the vLLM server", "chat completions with an image_url", "/v1/chat/completions"),
    "vit": ServedKind("the classifier server", "classify (base64 PNG or JPEG images)", "/v1/classify"),
}


def start_model_server(
    model: ModelConfig, model_dir: Path, serve: ServeConfig, name: str, log_path: Path, accelerator: str,
    on_wait: Callable[[float], None] | None = None,
) -> Server:  # fmt: skip
    """Start the server the serving check starts for `model`'s kind on `model_dir` (`tdeploy serve`): the
    classifier server (tasks/serve/classifier.py) for vit, vLLM (tasks/serve/server.py, with a vision-language
    folder's flags) otherwise; it answers /health when this returns."""
    if model.kind == "vit":
        return start_classifier(model_dir, serve, name, log_path, on_wait)
    return start_server(model_dir, serve, name, serve.max_model_len or model.seq_len, log_path, accelerator, on_wait)


ServingCheckReport = ServingReport | ClassifierReport | CaptioningReport
"""The full report of the serving check of any model.kind."""
StepServingResult = ServingResult | ClassifierServingResult | CaptioningServingResult


def run_check(inputs: ServingInputs) -> ServingCheckReport:
    """The serving check of the model's kind, its reports written into inputs.out_dir: vLLM for a language model
    (tasks/serve/check.py), the classifier server for model.kind vit (tasks/serve/classifier.py), vLLM with image
    requests for model.kind vlm (tasks/serve/captioning.py); the one place the step branches on the kind."""
    kind, out_dir = inputs.train.model.kind, Path(inputs.out_dir)
    if kind == "vit":
        return run_classifier_check(inputs.serve, inputs.train, inputs.accelerator, inputs.name, out_dir,
                                    inputs.export_root, inputs.step, inputs.model_dir, inputs.acceptance,
                                    inputs.pod_memory_bytes)  # fmt: skip
    if kind == "vlm":
        return run_captioning_check(inputs.serve, inputs.train, inputs.accelerator, inputs.name, out_dir,
                                    inputs.export_root, inputs.step, inputs.model_dir, inputs.pod_memory_bytes,
                                    inputs.acceptance)  # fmt: skip
    return run_serving_check(inputs.serve, inputs.train, inputs.accelerator, inputs.name, out_dir,
                             inputs.export_root, inputs.step, inputs.model_dir, inputs.quantization_json,
                             inputs.acceptance, inputs.pod_memory_bytes)  # fmt: skip


def result_of(report: ServingCheckReport) -> StepServingResult:
    """The step's small result of a report of any kind."""
    if isinstance(report, ClassifierReport):
        return ClassifierServingResult.of(report)
    if isinstance(report, CaptioningReport):
        return CaptioningServingResult.of(report)
    return ServingResult.of(report)


def run(inputs: ServingInputs, publish: Callable[[ServingCheckReport], None] | None = None) -> StepServingResult:
    """Export the checkpoint, serve it as its kind is served (`run_check`), load-test it and check its outputs;
    hand the report to `publish`; ServingCheckFailed naming the failed figures when one misses its threshold."""
    report = run_check(inputs)
    if publish is not None:
        publish(report)
    if not report.passed:
        raise ServingCheckFailed(f"serving check failed: {', '.join(report.failed)}", f"see {report.files['json']}")
    return result_of(report)
