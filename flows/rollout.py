"""Flow `rollout`: a new image on the canary first, then acceptance on the whole deployment, then its job.

A failing canary (or whole-deployment acceptance) stops the flow with the reason; the current version and its
baseline stay in place.
"""

from __future__ import annotations

from typing import Literal

from flows.deploy import load_or_diagnose
from tasks.acceptance.suite import workspace_root
from tasks.acceptance.task import run_acceptance
from tasks.deployment import dataset_check_inputs, planned_figures, training_config
from tasks.launch.task import submit_job
from tasks.ledger.registry import Provenance
from tasks.ledger.task import canary_rollout
from tasks.logs import install_user_error_filter
from tasks.pipeline import Results, SpecSource, diagnose_failure, spec_flow
from tasks.prepare.task import check_dataset, prepare_data


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
        prepare = parsed.data.prepare
        results["data"] = (
            prepare_data(prepare, parsed.storage) if prepare else check_dataset(*dataset_check_inputs(parsed))
        )
        train = training_config(parsed, results["data"])
        step = "canary"
        canary_rollout(parsed.name, parsed.cluster, train, parsed.acceptance, image)
        step = "acceptance"
        root = workspace_root(parsed.acceptance, train)
        provenance = Provenance.of(parsed, image_ref=image)
        results["acceptance"] = run_acceptance(
            parsed.cluster,
            train,
            parsed.acceptance,
            root,
            image,
            drills=parsed.drills,
            provenance=provenance,
            planned=planned_figures(parsed),
        )
        step = "job"
        results["job"] = submit_job(parsed.cluster, train, parsed.name, image, wait_until)
    except Exception as err:
        diagnose_failure(step, str(err), None, None, None)
        raise
    return results
