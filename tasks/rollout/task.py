"""Prefect task `canary_rollout` (the rollout flow's canary step; `tdeploy rollout` calls the same function)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.acceptance.report import table_rows
from tasks.rollout.canary import ARTIFACT, CanaryInputs, run_canary


@task(name="canary_rollout")
def canary_rollout(inputs: CanaryInputs) -> dict:
    """Run `inputs.image` on the canary, held to the baseline (see tasks/rollout/canary.py); RolloutStopped, with
    the failed figures, when it fails. Never retried: a failing canary is the answer, not a hiccup."""
    logger = get_run_logger()
    outcome = run_canary(inputs)
    description = f"canary of {inputs.image}: passed"
    create_table_artifact(key=ARTIFACT, table=table_rows(outcome.report), description=description)
    logger.info("canary of %s passed against entry %s (%s)", inputs.image, outcome.baseline_entry, outcome.root)
    return {"report": outcome.report.to_json(), "root": str(outcome.root), "baseline_entry": outcome.baseline_entry}
