"""Flow `rollout`: a new image on the canary first, then acceptance on the whole deployment, then its job.

A failing canary (or whole-deployment acceptance) stops the flow with the reason; the current version and its
baseline stay in place.
"""

from __future__ import annotations

from typing import Literal

from flows.deploy import data_task, load_or_diagnose
from tasks.acceptance.task import run_acceptance
from tasks.launch.step import JobInputs
from tasks.launch.task import submit_job
from tasks.logs import install_user_error_filter
from tasks.pipeline import Results, SpecSource, diagnose_failure, spec_flow
from tasks.prepare.step import data_and_training
from tasks.rollout.canary import CanaryInputs, rollout_acceptance
from tasks.rollout.task import canary_rollout


@spec_flow(name="rollout", description="Roll a new image out: canary, whole-deployment acceptance, then the job.")
def rollout(
    image: str,
    spec: SpecSource = "examples/local.yaml",
    wait_until: Literal["submitted", "running", "finished"] = "running",
) -> Results:
    """Roll `image` out to the spec's deployment, stopping at the first step that fails."""
    install_user_error_filter()
    parsed = load_or_diagnose(spec)
    results: Results = {}
    step = "data"
    try:
        results["data"], train = data_and_training(parsed, data_task)
        step = "canary"
        canary_rollout(CanaryInputs.of(parsed, train, image=image))
        step = "acceptance"
        results["acceptance"] = run_acceptance(rollout_acceptance(parsed, train, image))
        step = "job"
        results["job"] = submit_job(JobInputs.of(parsed, train, image, wait_until))
    except Exception as err:
        diagnose_failure(step, str(err), None, None, None)
        raise
    return results
