"""Flow `deploy-training`: capacity -> nodes -> image -> data -> job -> acceptance -> drills -> quantize ->
serving.

The flow walks the step list of tasks/steps.py (DEPLOY); each step is a Prefect task over its package's `run`,
handed the step's typed inputs (`<Step>Inputs.of(spec, ...)`, as the CLI's command for it), and it retries
transient errors only. The pure steps (plan, image, dataset) are cached on their inputs and the folder they run
in, so a re-run after a failure starts at the failed step; a cached result whose files are gone is void and its
step runs again (tasks/cache.py). A failed step stops the flow: the diagnosis runs, and the summary page says
which step failed and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.acceptance.record import latest_card
from tasks.acceptance.step import AcceptanceResult, AcceptanceStepInputs, DrillsInputs
from tasks.acceptance.task import run_acceptance, run_drills
from tasks.cache import cached_step_options
from tasks.capacity.step import CapacityInputs, CapacityResult, serving_pod_memory
from tasks.capacity.task import estimate_capacity
from tasks.image.step import ImageInputs, ImageStepResult
from tasks.image.task import build_image
from tasks.launch.step import JobInputs
from tasks.launch.task import submit_job
from tasks.ledger.task import record_serving_figures
from tasks.logs import install_user_error_filter
from tasks.nodes.step import NodesInputs
from tasks.nodes.task import check_nodes
from tasks.paths import DeploymentPaths
from tasks.pipeline import (
    Results,
    SpecSource,
    diagnose_failure,
    load_deployment_spec,
    publish_summary,
    spec_flow,
    spec_label,
)
from tasks.prepare.step import DataInputs, DataResult, check_served_data, data_and_training
from tasks.prepare.task import check_dataset, prepare_data
from tasks.progress import report_step
from tasks.quantize.step import QuantizeInputs, QuantizeResult
from tasks.quantize.task import quantize_model
from tasks.results import SkippedResult, StepResult
from tasks.serve.step import ServingInputs, ServingResult
from tasks.serve.task import serving_check
from tasks.spec import DeploymentSpec
from tasks.steps import DEPLOY
from training.config import TrainConfig

plan_step = estimate_capacity.with_options(timeout_seconds=1800, **cached_step_options())
image_step = build_image.with_options(**cached_step_options())
data_step = prepare_data.with_options(**cached_step_options())


def cached_data_task(inputs: DataInputs) -> DataResult:
    """The data step as deploy-training runs it: a preparation cached on its inputs, or the spec's own dataset's
    check (its verdict has a cache of its own)."""
    return data_step(inputs) if inputs.prepare is not None else check_dataset(inputs)


def data_task(inputs: DataInputs) -> DataResult:
    """The data step as the other flows run it: a preparation (a finished identical dataset is reused), or the
    spec's own dataset's check."""
    return prepare_data(inputs) if inputs.prepare is not None else check_dataset(inputs)


def load_or_diagnose(source: SpecSource) -> DeploymentSpec:
    """The validated spec; a bad one fails the flow at once, still with its diagnosis and summary."""
    try:
        return load_deployment_spec(source)
    except Exception as err:
        diagnosis = diagnose_failure("spec", str(err), None, None, None)
        publish_summary(spec_label(source), {}, "spec", f"{type(err).__name__}: {err}", diagnosis)
        raise


@dataclass
class Deployment:
    """What the steps of one deploy-training run hand on: the spec, the results so far (the drills reuse the
    acceptance step's workspace) and the training config on the data step's dataset."""

    spec: DeploymentSpec
    results: Results = field(default_factory=dict)
    train: TrainConfig | None = None

    @property
    def image(self) -> str | None:
        """The image the jobs run (the image step's pushed image by digest; None: the nodes' environment)."""
        built = self.results.get("image")
        return built.job_image if isinstance(built, ImageStepResult) else None

    def trained(self) -> TrainConfig:
        """The training config (the data step has run)."""
        assert self.train is not None, "the data step comes before the job"
        return self.train


def _capacity(run: Deployment) -> StepResult:
    return plan_step(CapacityInputs.of(run.spec))


def _nodes(run: Deployment) -> StepResult:
    return check_nodes(NodesInputs.of(run.spec))


def _image(run: Deployment) -> StepResult:
    return image_step(ImageInputs.of(run.spec))


def _data(run: Deployment) -> StepResult:
    data, run.train = data_and_training(run.spec, cached_data_task)
    run.results["data"] = data
    check_served_data(run.spec, data)
    return data


def _job(run: Deployment) -> StepResult:
    return submit_job(JobInputs.of(run.spec, run.trained(), run.image))


def _acceptance(run: Deployment) -> StepResult:
    built, capacity = run.results.get("image"), run.results.get("capacity")
    return run_acceptance(
        AcceptanceStepInputs.of(
            run.spec, run.trained(), image=built if isinstance(built, ImageStepResult) else None,
            capacity=capacity if isinstance(capacity, CapacityResult) else None,
        )
    )  # fmt: skip


def _drills(run: Deployment) -> StepResult:
    accepted = run.results.get("acceptance")
    assert isinstance(accepted, AcceptanceResult), "the acceptance step comes before the drills"
    return run_drills(DrillsInputs.of(run.spec, run.trained(), accepted=accepted, image=run.image))


def _quantize(run: Deployment) -> StepResult:
    if run.spec.quantize is None:
        return SkippedResult(reason="quantize: null")
    card = latest_card(DeploymentPaths.of(run.spec).acceptance_workspaces)  # the model card's training figures
    return quantize_model(QuantizeInputs.of(run.spec, run.trained(), acceptance=card))


def _serving(run: Deployment) -> StepResult:
    spec, train = run.spec, run.trained()
    if spec.serve is None:
        return SkippedResult(reason="serve: null")
    quantized, pod_memory = run.results.get("quantize"), serving_pod_memory(spec)
    if isinstance(quantized, QuantizeResult):  # the gated quantized folder is what gets served
        served = serving_check(ServingInputs.of(spec, train, step=quantized.step, model_dir=quantized.model_dir,
                                                  quantization_json=quantized.files.get("json"),
                                                  pod_memory_bytes=pod_memory))  # fmt: skip
    else:
        card = latest_card(DeploymentPaths.of(spec).acceptance_workspaces)  # the model card's training figures
        served = serving_check(ServingInputs.of(spec, train, acceptance=card, pod_memory_bytes=pod_memory))
    accepted = run.results.get("acceptance")
    entry = getattr(accepted, "report", {}).get("ledger_entry")
    if isinstance(served, ServingResult) and entry:  # the accepted entry's golden serving figures
        record_serving_figures(spec.acceptance, train, entry, served)
    return served


RUNNERS: dict[str, Callable[[Deployment], StepResult]] = {
    "capacity": _capacity,
    "nodes": _nodes,
    "image": _image,
    "data": _data,
    "job": _job,
    "acceptance": _acceptance,
    "drills": _drills,
    "quantize": _quantize,
    "serving": _serving,
}
assert list(RUNNERS) == [step.name for step in DEPLOY[1:]], "one runner per step of DEPLOY, in its order"


@spec_flow(name="deploy-training", description="Deploy a Transformer training job from its spec, step by step.")
def deploy_training(spec: SpecSource = "examples/local.yaml") -> Results:
    """Run the whole deployment sequence for one spec (a DeploymentSpec, its data, or a path/URL of its YAML)."""
    install_user_error_filter()
    report_step("deploy", DEPLOY, "spec")
    parsed = load_or_diagnose(spec)
    run = Deployment(parsed)
    step = DEPLOY[1].name
    try:
        for entry in DEPLOY[1:]:
            step = entry.name
            report_step("deploy", DEPLOY, step)
            run.results[step] = RUNNERS[step](run)
    except Exception as err:
        job = run.results.get("job")
        run_dir = getattr(job, "output_dir", None) or getattr(getattr(err, "handle", None), "output_dir", None)
        paths = DeploymentPaths.of(parsed)
        diagnosis = diagnose_failure(step, str(err), run_dir, paths.plan_url(), paths.node_report())
        publish_summary(parsed.name, run.results, step, f"{type(err).__name__}: {err}", diagnosis, parsed.reports_dir)
        raise
    report_step("deploy", DEPLOY, None)
    publish_summary(parsed.name, run.results, None, None, None, parsed.reports_dir)
    return run.results
