"""Prefect task `serving_check`: the serving step's `run`, the pipeline's step after acceptance."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.errors import retry_on_transient
from tasks.serve.chain import chain_rows
from tasks.serve.check import ServingReport
from tasks.serve.report import table_rows
from tasks.serve.step import ARTIFACT, CHAIN_ARTIFACT, ServingCheckReport, ServingInputs, StepServingResult, run


def publish(report: ServingCheckReport) -> None:
    """Publish the check table and (a language model's) the parity chain's; log each row."""
    logger = get_run_logger()
    verdict = report.to_json()["verdict"]
    create_table_artifact(key=ARTIFACT, table=table_rows(report), description=f"verdict: {verdict}")
    for row in table_rows(report):
        logger.info("%s: %s %s", row["check"], row["verdict"], row["message"])
    if not isinstance(report, ServingReport):  # a vision model's: parity is served against transformers' or ours
        return
    chain = "passed" if report.chain.passed else "failed"
    create_table_artifact(key=CHAIN_ARTIFACT, table=chain_rows(report.chain),
                          description=f"parity chain, training forward to served: {chain}")  # fmt: skip
    for row in chain_rows(report.chain):
        logger.info("parity %s, %s: %s %s (%s)", row["hop"], row["measure"], row["measured"], row["verdict"],
                    row["tolerance"])  # fmt: skip


@task(name="serving_check", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_on_transient)
def serving_check(inputs: ServingInputs) -> StepServingResult:
    """Export the accepted checkpoint, serve it as its model kind is served (vLLM, or the classifier server for a
    ViT), load-test it and check its outputs; fails when a figure misses its threshold."""
    return run(inputs, publish)
