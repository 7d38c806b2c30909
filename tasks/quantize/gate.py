"""The quantize step's work: export, quantize with LLM Compressor, serve the unquantized and the quantized folder
with the same vLLM settings, measure both (perplexity from the server's prompt log-probabilities, greedy tokens,
the load test, memory) and judge the quantized one (validation/quantization.py)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks import tables
from tasks.errors import UserError
from tasks.progress import report as report_progress
from tasks.quantize.config import QuantizeConfig, quantize_problems
from tasks.quantize.quantizer import QuantizedFolder, quantize_folder, weight_bytes
from tasks.serve.check import Judged, decode, forced_top1, prompt_logprobs, served_folder, served_greedy
from validation.quantization import (
    AgreementFigures,
    QuantizationCheck,
    ServedModelFigures,
    greedy_agreement,
    judge_quantization,
    perplexity,
)

if TYPE_CHECKING:
    from tasks.export.readme import AcceptanceFigures
    from tasks.serve.config import ServeConfig
    from training.config import TrainConfig

log = logging.getLogger(__name__)

QUANTIZATION_JSON = "quantization.json"
BASE_DIR = "unquantized"
QUANTIZED_DIR = "quantized"


@dataclass(frozen=True)
class GateData:
    """Held-out token ids: calibration sequences, perplexity sequences and greedy prompts."""

    calibration: list[list[int]]
    evaluation: list[list[int]]
    prompts: list[list[int]]
    split: str


def gate_data(train: TrainConfig, cfg: QuantizeConfig, prompt_tokens: int) -> GateData:
    """Calibration, perplexity and prompt sequences from the dataset's held-out split (the training split when
    there is none), spread over it; calibration and evaluation take different samples where the split has enough."""
    from training.dataset import TokenDataset, read_manifest

    url = train.data.dataset_url
    splits = read_manifest(url, train.storage, train.data.sources).splits
    split = train.data.val_split if train.data.val_split in splits else train.data.train_split
    cal_len = cfg.calibration_tokens or train.model.seq_len

    def spread(length: int, count: int, offset: int, total: int) -> list[list[int]]:
        data = TokenDataset(url, split, length - 1, train.storage, vocab_size=train.model.vocab_size,
                            trusted=train.data.sources)  # fmt: skip
        stride = max(1, len(data) // total)
        return [data.sample(((offset + i) * stride) % len(data)).tolist() for i in range(count)]

    n_cal = cfg.calibration_samples if cfg.method == "gptq" else 0
    total = n_cal + cfg.eval_samples + cfg.greedy_prompts
    return GateData(
        calibration=spread(cal_len, n_cal, 0, total) if n_cal else [],
        evaluation=spread(cfg.eval_tokens, cfg.eval_samples, n_cal, total),
        prompts=spread(prompt_tokens, cfg.greedy_prompts, n_cal + cfg.eval_samples, total),
        split=split,
    )


def measure_served(
    model_dir: Path, serve: ServeConfig, name: str, data: GateData, cfg: QuantizeConfig, accelerator: str,
    max_model_len: int, out_dir: Path, along: list[list[int]] | None = None,
) -> ServedModelFigures:  # fmt: skip
    """Serve `model_dir` with vLLM and measure it: perplexity on the evaluation sequences, greedy tokens of the
    prompts, its next tokens teacher-forced along `along` (the unquantized model's greedy continuations; its own
    when None), the serving check's load test, the server's resident memory; the server is stopped at the end."""
    from tasks.serve.load import run_load_test
    from tasks.serve.server import SERVER_LOG, start_server

    out_dir.mkdir(parents=True, exist_ok=True)
    server = start_server(model_dir, serve, name, max_model_len, out_dir / SERVER_LOG, accelerator)
    try:
        rss = server.rss_bytes()
        ppl, scored = perplexity([prompt_logprobs(server, seq) for seq in data.evaluation])
        greedy, _ = served_greedy(server, data.prompts, cfg.greedy_tokens)
        forced = [forced_top1(server, p, c) for p, c in zip(data.prompts, along or greedy, strict=True)]
        # distinct held-out prompts where there are enough (a repeated one would hit vLLM's prefix cache)
        texts = decode(model_dir, [s[: serve.check.prompt_tokens] for s in data.evaluation + data.prompts])
        count = serve.check.num_prompts
        load, _ = run_load_test(server, model_dir, (texts * count)[:count], serve.check, out_dir)
    finally:
        server.stop()
    return ServedModelFigures(
        model_dir=str(model_dir), perplexity=ppl, eval_tokens=scored, greedy=greedy, p99_e2e_ms=load.e2e_ms.p99,
        output_tokens_per_s=load.output_tokens_per_s, server_rss_bytes=rss, weight_bytes=weight_bytes(model_dir),
        forced_top1=forced,
    )  # fmt: skip


@dataclass(frozen=True)
class QuantizationReport(Judged):
    """Everything the quantize step made, measured and judged."""

    quantized: QuantizedFolder
    step: int | None
    split: str
    base: ServedModelFigures
    measured: ServedModelFigures
    agreement: AgreementFigures
    checks: list[QuantizationCheck]
    files: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """quantization.json's content."""
        data = asdict(self)
        data["verdict"] = "passed" if self.passed else "failed"
        data["agreement"]["share"] = self.agreement.share
        return data


def table_rows(report: QuantizationReport) -> list[dict[str, str]]:
    """One row per judged figure: name, verdict (passed, failed, or figure: reported, not gated), the value and its
    bound in the figure's unit (tasks/tables.py), message."""
    verdict = {True: "passed", False: "failed", None: "figure"}
    return [
        {"check": c.name, "verdict": verdict[c.passed], "measured": tables.value(c.name, c.value),
         "threshold": tables.value(c.name, c.bound), "message": c.message}  # fmt: skip
        for c in report.checks
    ]


def gate(
    base_dir: Path, quantized: QuantizedFolder, cfg: QuantizeConfig, serve: ServeConfig, name: str, data: GateData,
    accelerator: str, max_model_len: int, out_dir: Path, step: int | None = None,
    base: ServedModelFigures | None = None,
) -> QuantizationReport:  # fmt: skip
    """Measure the unquantized folder (unless `base` has its figures) and the quantized one under the same
    server settings, judge the quantized one, write quantization.json into `out_dir` (last)."""
    if base is None:
        report_progress("quantize", "serving the unquantized model")
        base = measure_served(base_dir, serve, name, data, cfg, accelerator, max_model_len, out_dir / BASE_DIR)
    report_progress("quantize", f"serving the {quantized.scheme} model")
    measured = measure_served(Path(quantized.model_dir), serve, name, data, cfg, accelerator, max_model_len,
                              out_dir / QUANTIZED_DIR, along=base.greedy)  # fmt: skip
    assert measured.forced_top1 is not None
    agreement = greedy_agreement(base.greedy, measured.forced_top1, cfg.greedy_tokens, free=measured.greedy)
    checks = judge_quantization(base, measured, agreement, cfg.max_ppl_increase, cfg.min_greedy_agreement)
    report = QuantizationReport(quantized, step, data.split, base, measured, agreement, checks, {})
    path = out_dir / QUANTIZATION_JSON
    report = replace(report, files={"json": str(path)})
    tmp = out_dir / f".{QUANTIZATION_JSON}.partial"
    tmp.write_text(json.dumps(report.to_json(), indent=2, default=str))
    tmp.replace(path)
    for check in checks:
        log.info("quantize %s: %s", check.name, check.message)
    return report


def run_quantization(
    cfg: QuantizeConfig, serve: ServeConfig, train: TrainConfig, accelerator: str, name: str, out_dir: Path,
    export_root: str, step: int | None = None, acceptance: AcceptanceFigures | None = None,
) -> QuantizationReport:  # fmt: skip
    """Export the newest sound (or the given) checkpoint (its model card with the `acceptance` figures),
    quantize it beside the export, gate it; the report says whether it passed."""
    problems = quantize_problems(cfg, serve, accelerator, train.model.seq_len)
    if problems:
        raise UserError("; ".join(f"{'.'.join(map(str, at))}={value}: {why}" for at, value, why in problems))
    out_dir.mkdir(parents=True, exist_ok=True)
    export_dir, exported_step = served_folder(
        train, step, None, export_root, acceptance, "LLM Compressor and vLLM read", stage="quantize"
    )
    data = gate_data(train, cfg, serve.check.prompt_tokens)
    report_progress("quantize", f"quantizing with LLM Compressor ({cfg.scheme}, {cfg.method})")
    started = time.monotonic()
    quantized = quantize_folder(export_dir, cfg, data.calibration, log_dir=out_dir)
    log.info("quantized %s to %s in %.0f s", export_dir, quantized.model_dir, time.monotonic() - started)
    max_model_len = serve.max_model_len or train.model.seq_len
    return gate(export_dir, quantized, cfg, serve, name, data, accelerator, max_model_len, out_dir, exported_step)
