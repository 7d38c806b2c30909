"""Prefect task `serving_check`: the pipeline's step after acceptance."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.deployment import ServingResult
from tasks.errors import UserError, retry_on_transient
from tasks.serve.check import ServingReport, run_serving_check
from tasks.serve.config import ServeConfig
from tasks.serve.report import table_rows
from training.config import TrainConfig


class ServingCheckFailed(UserError):
    """A served figure missed its threshold; serving.json says which and what to look at."""


def result_of(report: ServingReport) -> ServingResult:
    """The step's small result from the full report."""
    return ServingResult(
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


def check_serving(
    serve: ServeConfig,
    train: TrainConfig,
    accelerator: str,
    name: str,
    out_dir: str,
    export_root: str,
    step: int | None = None,
) -> ServingReport:
    """The serving check's full report (the CLI and the task share it); `gate` turns a failure into an error."""
    return run_serving_check(serve, train, accelerator, name, Path(out_dir), export_root, step)


def gate(report: ServingReport) -> ServingResult:
    """The step's result of a passed check; ServingCheckFailed naming the failed figures otherwise."""
    if not report.passed:
        raise ServingCheckFailed(f"serving check failed: {', '.join(report.failed)}", f"see {report.files['json']}")
    return result_of(report)


@task(name="serving_check", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def serving_check(
    serve: ServeConfig,
    train: TrainConfig,
    accelerator: str,
    name: str,
    out_dir: str,
    export_root: str,
    step: int | None = None,
) -> ServingResult:
    """Export the accepted checkpoint, serve it with vLLM, load-test it and check its outputs; fails when a figure
    misses its threshold."""
    logger = get_run_logger()
    report = check_serving(serve, train, accelerator, name, out_dir, export_root, step)
    verdict = report.to_json()["verdict"]
    create_table_artifact(key="serving", table=table_rows(report), description=f"verdict: {verdict}")
    for row in table_rows(report):
        logger.info("%s: %s %s", row["check"], row["verdict"], row["message"])
    return gate(report)
