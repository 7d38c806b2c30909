"""The quantize step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tasks.errors import UserError
from tasks.export.readme import AcceptanceFigures
from tasks.paths import DeploymentPaths
from tasks.quantize.config import QuantizeConfig
from tasks.quantize.gate import QuantizationReport, run_quantization
from tasks.results import StepResult
from tasks.serve.config import ServeConfig
from training.config import TrainConfig

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

TITLE = "quantization gate"
ARTIFACT = "quantization"


class QuantizationGateFailed(UserError):
    """The quantized model missed the perplexity or greedy-agreement bound; quantization.json says by how much."""


class QuantizeInputs(BaseModel):
    """What the quantize step reads: its section, the serve section both models are served with, the training
    config whose checkpoint is exported, the accelerator, the served name and its folders."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    quantize: QuantizeConfig
    serve: ServeConfig
    train: TrainConfig
    accelerator: str
    name: str
    out_dir: str
    """quantization.json, quantize.log and each model's server log and load test (<reports>/quantize)."""
    export_root: str
    """The folder the checkpoint is exported under; the quantized folder is the export's sibling."""
    step: int | None = None
    """The checkpoint step to export and quantize (None: the newest sound one)."""
    acceptance: AcceptanceFigures | None = None
    """The acceptance figures the exported folder's model card shows (the deployment's latest)."""

    @classmethod
    def of(
        cls, spec: DeploymentSpec, train: TrainConfig, folder: str | None = None, step: int | None = None,
        acceptance: AcceptanceFigures | None = None,
    ) -> QuantizeInputs:  # fmt: skip
        """The quantize step of `spec` (`train`: data_and_training's); quantize: null is the caller's case (the
        spec refuses a quantize section without a serve section)."""
        assert spec.quantize is not None and spec.serve is not None, "callers handle quantize: null"
        paths = DeploymentPaths.of(spec)
        return cls(
            quantize=spec.quantize, serve=spec.serve, train=train, accelerator=spec.cluster.accelerator,
            name=spec.name, out_dir=paths.quantize_dir(folder), export_root=paths.export_dir, step=step,
            acceptance=acceptance,
        )  # fmt: skip


class QuantizeResult(StepResult):
    """The quantized folder and its gate: perplexity, greedy agreement, and size, memory, P99 and throughput
    against the unquantized model."""

    verdict_text: str
    model_dir: str
    source_dir: str
    scheme: str
    method: str
    step: int | None
    ppl_unquantized: float
    ppl_quantized: float
    greedy_agreement: float
    weight_bytes: int
    source_weight_bytes: int
    p99_e2e_ms: float
    p99_e2e_ms_unquantized: float
    output_tokens_per_s: float
    output_tokens_per_s_unquantized: float
    files: dict[str, str]
    failed: list[str] = []

    @classmethod
    def of(cls, report: QuantizationReport) -> QuantizeResult:
        """The step's small result from the full report."""
        return cls(
            verdict_text="passed" if report.passed else "failed", model_dir=report.quantized.model_dir,
            source_dir=report.quantized.source_dir, scheme=report.quantized.scheme, method=report.quantized.method,
            step=report.step, ppl_unquantized=report.base.perplexity, ppl_quantized=report.measured.perplexity,
            greedy_agreement=report.agreement.share, weight_bytes=report.measured.weight_bytes,
            source_weight_bytes=report.base.weight_bytes, p99_e2e_ms=report.measured.p99_e2e_ms,
            p99_e2e_ms_unquantized=report.base.p99_e2e_ms, output_tokens_per_s=report.measured.output_tokens_per_s,
            output_tokens_per_s_unquantized=report.base.output_tokens_per_s, files=report.files,
            failed=report.failed,
        )  # fmt: skip

    def summary(self) -> str:
        """Verdict, scheme, perplexity, agreement, size, P99 and throughput against the unquantized model."""
        return (
            f"{self.verdict_text}: {self.scheme} ({self.method}) of step {self.step}; perplexity "
            f"{self.ppl_unquantized:.3f} -> {self.ppl_quantized:.3f}; greedy agreement {self.greedy_agreement:.1%}; "
            f"weights {self.source_weight_bytes / 1e6:.1f} -> {self.weight_bytes / 1e6:.1f} MB; P99 "
            f"{self.p99_e2e_ms_unquantized:.1f} -> {self.p99_e2e_ms:.1f} ms; "
            f"{self.output_tokens_per_s_unquantized:.0f} -> {self.output_tokens_per_s:.0f} tokens/s; "
            f"`{self.model_dir}`"
        )

    def artifact_problem(self, inputs: object) -> str | None:
        """A cached result whose quantized folder is gone is void."""
        if not (Path(self.model_dir) / "QUANTIZE.json").is_file():
            return f"{self.model_dir}: no QUANTIZE.json"
        return None


def run(inputs: QuantizeInputs, publish: Callable[[QuantizationReport], None] | None = None) -> QuantizeResult:
    """Export, quantize and gate; hand the report to `publish`; QuantizationGateFailed naming the failed figures
    when the quantized model misses a bound."""
    report = run_quantization(inputs.quantize, inputs.serve, inputs.train, inputs.accelerator, inputs.name,
                              Path(inputs.out_dir), inputs.export_root, inputs.step, inputs.acceptance)  # fmt: skip
    if publish is not None:
        publish(report)
    if not report.passed:
        raise QuantizationGateFailed(
            f"quantization gate failed: {', '.join(report.failed)}", f"see {report.files['json']}; keep the "
            "unquantized model, or try another quantize.scheme / method, or loosen the bound if the loss is acceptable",
        )  # fmt: skip
    return QuantizeResult.of(report)
