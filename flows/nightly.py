"""Flow `nightly-validation`: on an existing deployment, a longer acceptance soak and every drill.

The acceptance step holds the soak to the ledger's current baseline of the spec and cluster (the regression
gate: tokens/s, step time, checkpoint save time, the loss curve at the same seed); the soak's own curve identity
differs from the deployment's when acceptance.soak_steps is set, so its loss curve is compared with earlier
nights' only."""

from __future__ import annotations

from flows.deploy import load_or_diagnose
from tasks.acceptance.suite import workspace_root
from tasks.acceptance.task import run_acceptance, run_drills
from tasks.deployment import dataset_check_inputs, planned_figures, training_config
from tasks.ledger.registry import Provenance
from tasks.logs import install_user_error_filter
from tasks.pipeline import STEP_TITLES, Results, SpecSource, diagnose_failure, publish_summary, spec_flow
from tasks.prepare.task import check_dataset, prepare_data
from tasks.progress import report

STEPS = ("spec", "data", "acceptance", "drills")


@spec_flow(
    name="nightly-validation", description="Acceptance with a stability soak, and the checkpoint-restore drills."
)
def nightly_validation(spec: SpecSource = "examples/local.yaml") -> Results:
    """Re-accept a deployment: soak-length acceptance, then every drill; publish the report."""
    install_user_error_filter()
    report("nightly", STEP_TITLES["spec"], 0, len(STEPS))
    spec = load_or_diagnose(spec)
    results: Results = {}
    step = "data"

    def begin(name: str) -> str:
        report("nightly", STEP_TITLES[name], STEPS.index(name), len(STEPS))
        return name

    try:
        begin(step)
        prepare = spec.data.prepare  # a prepared dataset is reused; a given one's verdict is cached
        results["data"] = prepare_data(prepare, spec.storage) if prepare else check_dataset(*dataset_check_inputs(spec))
        train = training_config(spec, results["data"])
        root = workspace_root(spec.acceptance, train, nightly=True)  # a fresh workspace per night
        step = begin("acceptance")
        results["acceptance"] = run_acceptance(
            spec.cluster,
            train,
            spec.acceptance,
            root,
            soak=True,
            drills=spec.drills,
            provenance=Provenance.of(spec),
            planned=planned_figures(spec),
        )
        step = begin("drills")
        results["drills"] = run_drills(spec.cluster, train, spec.acceptance, spec.drills, root)
    except Exception as err:
        diagnosis = diagnose_failure(step, str(err), None, None, None)
        publish_summary(spec.name, results, step, f"{type(err).__name__}: {err}", diagnosis, spec.reports_dir)
        raise
    report("nightly", "done", len(STEPS), len(STEPS))
    publish_summary(spec.name, results, None, None, None, spec.reports_dir)
    return results
