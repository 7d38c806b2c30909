"""Prefect task `quantize_model`: the quantize step's `run`, the pipeline's step before serving."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.errors import retry_on_transient
from tasks.quantize.gate import QuantizationReport, table_rows
from tasks.quantize.step import ARTIFACT, QuantizeInputs, QuantizeResult, run


def publish(report: QuantizationReport) -> None:
    """Publish the gate's table; log each row."""
    logger = get_run_logger()
    verdict = report.to_json()["verdict"]
    create_table_artifact(key=ARTIFACT, table=table_rows(report), description=f"verdict: {verdict}")
    for row in table_rows(report):
        logger.info("%s: %s %s", row["check"], row["verdict"], row["message"])


@task(name="quantize_model", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def quantize_model(inputs: QuantizeInputs) -> QuantizeResult:
    """Export the accepted checkpoint, quantize it with LLM Compressor, serve both with vLLM and gate the quantized
    one; fails when it misses a bound."""
    return run(inputs, publish)
