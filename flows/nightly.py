"""Flow `nightly-validation`: on an existing deployment, a longer acceptance soak and every drill.

The acceptance step holds the soak to the ledger's current baseline of the spec and cluster (the regression
gate: tokens/s, step time, checkpoint save time, the loss curve at the same seed); the soak's own curve identity
differs from the deployment's when acceptance.soak_steps is set, so its loss curve is compared with earlier
nights' only. The flow walks the step list NIGHTLY of tasks/steps.py."""

from __future__ import annotations

from collections.abc import Callable

from flows.deploy import Deployment, data_task, load_or_diagnose
from tasks.acceptance.mode import Mode
from tasks.acceptance.step import AcceptanceResult, AcceptanceStepInputs, DrillsInputs
from tasks.acceptance.task import run_acceptance, run_drills
from tasks.logs import install_user_error_filter
from tasks.pipeline import Results, SpecSource, diagnose_failure, publish_summary, spec_flow
from tasks.prepare.step import data_and_training
from tasks.progress import report_step
from tasks.results import SkippedResult, StepResult
from tasks.soak.step import SoakInputs
from tasks.soak.task import run_soak_step
from tasks.steps import NIGHTLY


def _data(run: Deployment) -> StepResult:
    data, run.train = data_and_training(run.spec, data_task)  # a prepared dataset is reused; a given one's verdict
    return data  # is cached


def _acceptance(run: Deployment) -> StepResult:  # a fresh workspace per night, under nightly/
    return run_acceptance(AcceptanceStepInputs.of(run.spec, run.trained(), mode=Mode.SOAK, nightly=True))


def _drills(run: Deployment) -> StepResult:
    accepted = run.results.get("acceptance")
    assert isinstance(accepted, AcceptanceResult), "the acceptance step comes before the drills"
    return run_drills(DrillsInputs.of(run.spec, run.trained(), accepted=accepted))


def _soak(run: Deployment) -> StepResult:
    if run.spec.soak is None:
        return SkippedResult(reason="the spec has no soak section")
    return run_soak_step(SoakInputs.of(run.spec, run.trained(), run.spec.soak, nightly=True))


RUNNERS: dict[str, Callable[[Deployment], StepResult]] = {
    "data": _data, "acceptance": _acceptance, "drills": _drills, "soak": _soak,
}  # fmt: skip
assert list(RUNNERS) == [step.name for step in NIGHTLY[1:]], "one runner per step of NIGHTLY, in its order"


@spec_flow(
    name="nightly-validation", description="Acceptance with a stability soak, and the checkpoint-restore drills."
)
def nightly_validation(spec: SpecSource = "examples/local.yaml") -> Results:
    """Re-accept a deployment: soak-length acceptance, then every drill; publish the report."""
    install_user_error_filter()
    report_step("nightly", NIGHTLY, "spec")
    parsed = load_or_diagnose(spec)
    run = Deployment(parsed)
    step = NIGHTLY[1].name
    try:
        for entry in NIGHTLY[1:]:
            step = entry.name
            report_step("nightly", NIGHTLY, step)
            run.results[step] = RUNNERS[step](run)
    except Exception as err:
        diagnosis = diagnose_failure(step, str(err), None, None, None)
        publish_summary(
            parsed.name, run.results, step, f"{type(err).__name__}: {err}", diagnosis, parsed.reports_dir, NIGHTLY
        )
        raise
    report_step("nightly", NIGHTLY, None)
    publish_summary(parsed.name, run.results, None, None, None, parsed.reports_dir, NIGHTLY)
    return run.results
