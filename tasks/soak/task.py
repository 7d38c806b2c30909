"""Prefect task `run_soak_step`: the soak step's `run`, publishing its table."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks import tables
from tasks.soak import step
from tasks.soak.result import SoakResult
from tasks.soak.step import ARTIFACT, SoakInputs


def publish(result: SoakResult) -> None:
    """Publish one row per injected failure; log the summary."""
    rows = [{"failure": f.kind, "injected at": tables.value("at_s", round(f.injected_at_s)), "target": f.target,
             "rung": f.rung or "-", "steps lost": tables.value("steps", f.steps_lost),
             "recovery": tables.value("recovery_s", f.recovery_s), "problem": f.problem}
            for f in result.failures]  # fmt: skip
    create_table_artifact(key=ARTIFACT, table=rows, description=result.summary())
    get_run_logger().info("soak: %s", result.summary())


@task(name="run_soak")
def run_soak_step(inputs: SoakInputs) -> SoakResult:
    """Run the soak (never retried: a failed soak is a finding)."""
    return step.run(inputs, publish)
