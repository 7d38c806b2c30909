"""The capacity step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from tasks.capacity.calibration import Calibration
from tasks.capacity.config import CapacityConfig
from tasks.capacity.memory import GIB
from tasks.capacity.catalogue import resolve_accelerator
from tasks.capacity.params import Architecture
from tasks.capacity.plan import CapacityPlan, make_plan, plan_capacity, serving_plan, write_plan
from tasks.capacity.record import UnreadablePlan, read_plan
from tasks.launch.cluster import ClusterConfig
from tasks.paths import DeploymentPaths
from tasks.results import Figure, StepResult
from tasks.serve.config import ServeConfig
from training.config import CheckpointConfig, DistillConfig, ModelConfig, ParallelConfig, PrecisionConfig, RunConfig
from training.storage import StorageConfig
from validation.plan_accuracy import PlannedFigures

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

TITLE = "capacity estimation"
ARTIFACT = "capacity-plan"
MEMORY_ARTIFACT = "capacity-memory"


class CapacityInputs(BaseModel):
    """What the capacity step reads: the spec's sections the planner needs, and the ledger that calibrates it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    capacity: CapacityConfig
    cluster: ClusterConfig
    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    run: RunConfig
    serve: ServeConfig | None = None
    ledger: str | None = None
    """The ledger whose accepted runs on the accelerator calibrate the plan (None: capacity.calibration_url)."""
    storage: StorageConfig | None = None
    plan_url: str
    """Where plan.json goes (tasks.paths)."""
    checkpoint: CheckpointConfig | None = None
    """The checkpoint tiers whose intervals the plan chooses (tasks/capacity/interval.py; None: not planned)."""
    exposure_url: str | None = None
    """The deployment's exposure records (the observed failure rate; tasks/recovery/exposure.py)."""
    distill: DistillConfig | None = None
    """The teacher every rank holds and runs forward (its teacher_model as the spec filled it in)."""

    @classmethod
    def of(cls, spec: DeploymentSpec, folder: str | None = None) -> CapacityInputs:
        """The capacity step of `spec`, plan.json in `folder` (default: capacity.output_url)."""
        paths = DeploymentPaths.of(spec)
        return cls(
            name=spec.name, capacity=spec.capacity, cluster=spec.cluster, model=spec.model, parallel=spec.parallel,
            precision=spec.precision, run=spec.run, serve=spec.serve, ledger=paths.ledger_url, storage=spec.storage,
            plan_url=paths.plan_url(folder), checkpoint=spec.checkpoint, exposure_url=paths.exposure_url,
            distill=spec.distill,
        )  # fmt: skip

    def estimate(self, calibration: Calibration | None = None) -> CapacityPlan:
        """The plan with `calibration` (None: capacity.calibration_url's entry; the ledger is not read)."""
        return plan_capacity(self.name, self.capacity, self.cluster, self.model, self.parallel, self.precision,
                             self.run, self.serve, calibration, self.distill)  # fmt: skip

    def make(self) -> CapacityPlan:
        """The deployment's plan, calibrated from the ledger's accepted runs where it has some (`make_plan`), with
        each checkpoint tier's interval (Young/Daly: `tasks.capacity.interval`)."""
        from tasks.capacity.interval import interval_plan_of  # noqa: PLC0415 - it reads this module's inputs

        plan = make_plan(self.name, self.capacity, self.cluster, self.model, self.parallel, self.precision,
                         self.run, self.serve, self.ledger, self.storage, self.distill)  # fmt: skip
        if self.checkpoint is not None:
            plan.checkpoint_interval = interval_plan_of(self, plan)
        return plan

    def planned(self) -> PlannedFigures:
        """The plan's own (uncalibrated) figures for the layout, that acceptance compares with a run."""
        from tasks.capacity.calibration import NONE

        return self.estimate(NONE).planned()


class CapacityResult(StepResult):
    """The capacity plan of the requested layout."""

    plan_url: str
    fits: bool
    layout: str
    peak_bytes: int
    usable_bytes: int
    step_seconds: float
    planned: PlannedFigures | None = None
    """The planner's own figures that acceptance holds the run to (uncalibrated)."""
    calibration: str = "none"
    """Where the plan's calibration came from: none, the calibration file, or the ledger's accepted runs."""

    @classmethod
    def of(cls, plan: CapacityPlan, plan_url: str) -> CapacityResult:
        """The result of a written plan."""
        ev = plan.requested
        return cls(
            plan_url=plan_url,
            fits=plan.fits,
            layout=ev.layout.describe(),
            peak_bytes=int(ev.memory.total),
            usable_bytes=int(ev.usable_bytes),
            step_seconds=ev.step_seconds,
            planned=plan.planned(),
            calibration=plan.calibration.source,
        )

    def artifact_problem(self, inputs: Any) -> str | None:
        """plan.json must be there and readable (read_plan reads it back)."""
        try:
            read_plan(self.plan_url, getattr(inputs, "storage", None))
        except UnreadablePlan as err:
            return f"{self.plan_url} is missing" if err.problem == "no such file" else err.message
        return None

    def figures(self) -> dict[str, Figure]:
        """Fit, layout, peak and usable memory per device, the planned step time, the calibration and the plan."""
        return {"fits": self.fits, "layout": self.layout, "peak_bytes": self.peak_bytes,
                "usable_bytes": self.usable_bytes, "step_s": self.step_seconds, "calibration": self.calibration,
                "plan_url": self.plan_url}  # fmt: skip

    def summary(self) -> str:
        """Fit, peak memory per device, step time and where the plan is."""
        return (
            f"fits: {self.fits}; peak {self.peak_bytes / GIB:.2f} GiB of {self.usable_bytes / GIB:.2f} GiB usable "
            f"per device ({self.layout}); step {self.step_seconds:.3g} s; plan `{self.plan_url}`"
        )


def run(inputs: CapacityInputs, publish: Callable[[CapacityPlan, str], None] | None = None) -> CapacityResult:
    """Plan, write plan.json, hand the plan to `publish`; CapacityError when the layout does not fit and
    capacity.enforce is set."""
    plan = inputs.make()
    url = write_plan(plan, inputs.plan_url.rpartition("/")[0])
    if publish is not None:
        publish(plan, url)
    if not plan.fits and inputs.capacity.enforce:
        raise plan.error()
    return CapacityResult.of(plan, url)


def serving_pod_memory(spec: DeploymentSpec) -> float | None:
    """One vLLM server pod's memory by the serving plan of spec.serve (plan.json's `serving`), without planning
    the training layouts: the serving manifests' memory request and limit (None: serve is off)."""
    if spec.serve is None:
        return None
    accelerator = resolve_accelerator(spec.cluster.accelerator, spec.capacity.accelerator_overrides())
    arch = Architecture.from_model_config(spec.model, name=spec.name)
    return serving_plan(arch, accelerator, spec.serve, spec.precision).pod_memory_bytes(accelerator)
