"""Flow `rollback-deployment`: resubmit an earlier ledger entry's image, resumed from its accepted checkpoint."""

from __future__ import annotations

from typing import Literal

from flows.deploy import data_task, load_or_diagnose
from tasks.ledger.rollback import RollbackOutcome
from tasks.ledger.task import rollback_deployment
from tasks.logs import install_user_error_filter
from tasks.pipeline import SpecSource, diagnose_failure, spec_flow
from tasks.prepare.step import data_and_training


@spec_flow(name="rollback-deployment", description="Roll a deployment back to an earlier accepted ledger entry.")
def rollback(
    spec: SpecSource = "examples/local.yaml",
    to: str | None = None,
    wait_until: Literal["submitted", "running", "finished"] = "running",
) -> RollbackOutcome:
    """Roll the spec's deployment back to entry `to` (None: the one before the current baseline)."""
    install_user_error_filter()
    parsed = load_or_diagnose(spec)
    step = "data"
    try:
        _, train = data_and_training(parsed, data_task)
        step = "job"
        return rollback_deployment(parsed.name, parsed.cluster, train, parsed.acceptance, parsed.image, to, wait_until)
    except Exception as err:
        diagnose_failure(step, str(err), None, None, None)
        raise
