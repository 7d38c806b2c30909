"""Flow `deploy-training`: capacity -> nodes -> image -> data -> job -> acceptance -> drills -> serving.

Each step is a Prefect task that retries transient errors only. The pure steps
(plan, image, dataset) are cached on their inputs and the folder they run in, so a
re-run after a failure starts at the failed step; a cached result whose files are
gone is void and its step runs again (tasks/cache.py). A failed step stops the flow: the diagnosis runs, and
the summary page says which step failed and why.
"""

from __future__ import annotations

from tasks.acceptance.suite import workspace_root
from tasks.acceptance.task import run_acceptance, run_drills
from tasks.cache import cached_step_options
from tasks.capacity.task import estimate_capacity
from tasks.deployment import (
    ServingResult,
    SkippedResult,
    calibration_inputs,
    check_served_data,
    dataset_check_inputs,
    image_inputs,
    node_report_path,
    plan_inputs,
    plan_url,
    serving_inputs,
    training_config,
)
from tasks.image.task import build_image
from tasks.launch.task import submit_job
from tasks.ledger.registry import Provenance
from tasks.ledger.task import record_serving_figures
from tasks.logs import install_user_error_filter
from tasks.nodes.task import check_nodes
from tasks.pipeline import (
    STEP_TITLES,
    STEPS,
    Results,
    SpecSource,
    diagnose_failure,
    load_deployment_spec,
    publish_summary,
    spec_flow,
    spec_label,
)
from tasks.prepare.task import check_dataset, prepare_data
from tasks.progress import report
from tasks.serve.task import serving_check
from tasks.spec import DeploymentSpec

plan_step = estimate_capacity.with_options(timeout_seconds=1800, **cached_step_options())
image_step = build_image.with_options(**cached_step_options())
data_step = prepare_data.with_options(**cached_step_options())


def load_or_diagnose(source: SpecSource) -> DeploymentSpec:
    """The validated spec; a bad one fails the flow at once, still with its diagnosis and summary."""
    try:
        return load_deployment_spec(source)
    except Exception as err:
        diagnosis = diagnose_failure("spec", str(err), None, None, None)
        publish_summary(spec_label(source), {}, "spec", f"{type(err).__name__}: {err}", diagnosis)
        raise


@spec_flow(name="deploy-training", description="Deploy a Transformer training job from its spec, step by step.")
def deploy_training(spec: SpecSource = "examples/local.yaml") -> Results:
    """Run the whole deployment sequence for one spec (a DeploymentSpec, its data, or a path/URL of its YAML)."""
    install_user_error_filter()
    report("deploy", STEP_TITLES["spec"], 0, len(STEPS))
    spec = load_or_diagnose(spec)
    results: Results = {}
    step = "capacity"

    def begin(name: str) -> str:
        report("deploy", STEP_TITLES[name], STEPS.index(name), len(STEPS))
        return name

    try:
        begin(step)
        results["capacity"] = plan_step(*plan_inputs(spec), *calibration_inputs(spec))
        step = begin("nodes")
        results["nodes"] = check_nodes(spec.nodes, spec.cluster, node_report_path(spec))
        step = begin("image")
        results["image"] = built = image_step(*image_inputs(spec).args())
        step = begin("data")
        prepare = spec.data.prepare
        results["data"] = data = (
            data_step(prepare, spec.storage) if prepare else check_dataset(*dataset_check_inputs(spec))
        )
        check_served_data(spec, data)
        train = training_config(spec, data)
        image = built.job_image
        step = begin("job")
        results["job"] = submit_job(spec.cluster, train, spec.name, image)
        root = workspace_root(spec.acceptance, train)  # this run's own acceptance workspace: nothing resumes
        step = begin("acceptance")
        results["acceptance"] = run_acceptance(
            spec.cluster,
            train,
            spec.acceptance,
            root,
            image,
            drills=spec.drills,
            provenance=Provenance.of(spec, built),
            planned=results["capacity"].planned,
        )
        step = begin("drills")
        results["drills"] = run_drills(spec.cluster, train, spec.acceptance, spec.drills, root, image=image)
        step = begin("serving")
        results["serving"] = served = (
            serving_check(*serving_inputs(spec, train))
            if spec.serve is not None
            else SkippedResult(reason="serve: null")
        )
        entry = results["acceptance"].report.get("ledger_entry")
        if isinstance(served, ServingResult) and entry:  # the accepted entry's golden serving figures
            record_serving_figures(spec.acceptance, train, entry, served)
    except Exception as err:
        job = results.get("job")
        run_dir = job.output_dir if job else getattr(getattr(err, "handle", None), "output_dir", None)
        diagnosis = diagnose_failure(step, str(err), run_dir, plan_url(spec), node_report_path(spec))
        publish_summary(spec.name, results, step, f"{type(err).__name__}: {err}", diagnosis, spec.reports_dir)
        raise
    report("deploy", "done", len(STEPS), len(STEPS))
    publish_summary(spec.name, results, None, None, None, spec.reports_dir)
    return results
