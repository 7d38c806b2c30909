"""The acceptance and drills steps: their inputs from the spec and earlier results, their plain `run`s (what the
flows' tasks and `tdeploy accept` / `tdeploy drill` call), their result and the constants their tasks use."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.mode import Mode
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.report import write_files
from tasks.acceptance.suite import AcceptanceInputs, run_acceptance, run_drill_suite, workspace_root
from tasks.acceptance.workspace import Workspace, mark_latest, open_workspace
from tasks.capacity.step import CapacityInputs, CapacityResult
from tasks.errors import UserError
from tasks.image.step import ImageStepResult
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.ledger.registry import Provenance
from tasks.paths import DeploymentPaths
from tasks.results import Figure, StepResult
from training.config import TrainConfig
from training.run_output import DistillationRecord
from validation.goodput import Goodput

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

log = logging.getLogger(__name__)

TITLE = "acceptance tests"
ARTIFACT = "acceptance"
DRILLS_TITLE = "checkpoint-restore drills"
DRILLS_ARTIFACT = "drills"


STATUS = {True: "passed", False: "failed", None: "not measured"}
DRILL_STATUS = {True: "passed", False: "failed", None: "n/a"}
PERFORMANCE_FIGURES = ("tokens_per_s", "scaling_efficiency", "comm_share")
"""The performance dimension's figures the run's summary carries."""


class AcceptanceResult(StepResult):
    """An acceptance (or drills) run: its verdict, its report and where its files are."""

    verdict_text: str
    files: dict[str, str | None]
    report: dict[str, Any]
    root: str
    latest: str | None = None

    def figures(self) -> dict[str, Figure]:
        """Each dimension's and drill's status (a drill's recovery in seconds), the performance figures
        (tokens/s, scaling efficiency, communication share) and the goodput share, from the report."""
        figures: dict[str, Figure] = {d["name"]: STATUS[d.get("passed")] for d in self.report.get("dimensions", [])}
        for d in self.report.get("drills", []):
            figures[f"drill_{d['name']}"] = DRILL_STATUS[d.get("passed")]
            if d.get("recovery_s") is not None:
                figures[f"drill_{d['name']}_recovery_s"] = d["recovery_s"]
        performance = next((d for d in self.report.get("dimensions", []) if d["name"] == "performance"), None)
        measured = (performance or {}).get("measured") or {}
        figures |= {k: measured[k] for k in PERFORMANCE_FIGURES if isinstance(measured.get(k), int | float)}
        if self.report.get("goodput"):
            figures["goodput_share"] = Goodput.from_json(self.report["goodput"]).goodput
        return figures

    def note(self) -> str:
        """The capacity plan beside the run, and a distilled student beside its teacher, in words."""
        plan, distillation = self.report.get("plan_accuracy"), self.report.get("distillation")
        lines = [plan["line"] if plan else "",
                 DistillationRecord.from_json(distillation).summary() if distillation else ""]  # fmt: skip
        return "; ".join(line for line in lines if line)

    def summary(self) -> str:
        """The verdict and each dimension's and drill's outcome."""
        verdicts = {True: "pass", False: "FAIL", None: "not measured"}
        rows = [f"{d['name']} {verdicts[d['passed']]}" for d in self.report.get("dimensions", [])]
        rows += [
            f"{d['name']} {'pass' if d['passed'] else ('n/a' if d['passed'] is None else 'FAIL')}"
            + (f" (recovery {d['recovery_s']:.1f} s)" if d.get("recovery_s") is not None else "")
            for d in self.report.get("drills", [])
        ]
        text = ", ".join(rows)
        plan = self.report.get("plan_accuracy")
        if plan:  # the capacity plan beside what the run measured
            text = f"{text}; {plan['line']}" if text else plan["line"]
        if self.report.get("goodput"):  # the distributed run's
            line = Goodput.from_json(self.report["goodput"]).describe()
            text = f"{text}; {line}" if text else line
        if self.report.get("distillation"):  # the student beside its teacher
            line = DistillationRecord.from_json(self.report["distillation"]).summary()
            text = f"{text}; {line}" if text else line
        return f"{self.verdict_text}: {text}"


class AcceptanceFailed(UserError):
    """A dimension or drill failed; the report says which and what to look at first."""


Publish = Callable[[AcceptanceReport, dict[str, str | None]], None]
"""Shows a written report: the report and its files by kind (json, junit, plot)."""


def _acceptance_section(spec: DeploymentSpec, work_url: str | None) -> AcceptanceConfig:
    """The spec's acceptance section, its run workspaces (and a ledger of its own) under `work_url` when given."""
    return spec.acceptance if work_url is None else spec.acceptance.model_copy(update={"work_url": work_url})


class AcceptanceStepInputs(AcceptanceInputs):
    """The acceptance step: the suite's inputs and the fresh run workspace it runs in."""

    root: str
    """The run workspace, <work_url>/<run-id> (under nightly/ for the nightly runs); emptied when the step starts."""

    @classmethod
    def of(
        cls,
        spec: DeploymentSpec,
        train: TrainConfig,
        *,
        image: ImageStepResult | str | None = None,
        capacity: CapacityResult | None = None,
        mode: Mode = Mode.FULL,
        with_drills: bool = False,
        nightly: bool = False,
        work_url: str | None = None,
        environment: JobEnvironment | None = None,
    ) -> AcceptanceStepInputs:
        """The acceptance of `train` (data_and_training's) by `spec`: in the image step's image (or the image
        reference `image`; None: the nodes' environment), recorded with the spec's and the image's provenance, its
        memory and step time beside the capacity step's planned figures (`capacity`; None: the plan's own for the
        spec's layout), in a new run workspace under acceptance.work_url (`work_url`: another folder)."""
        built = image if isinstance(image, ImageStepResult) else None
        ref = built.job_image if built is not None else image if isinstance(image, str) else None
        acceptance = _acceptance_section(spec, work_url)
        return cls(
            cluster=spec.cluster, train=train, acceptance=acceptance, mode=mode, drills=spec.drills,
            with_drills=with_drills, image=ref, environment=environment,
            provenance=Provenance.of(spec, built, image_ref=ref),
            planned=capacity.planned if capacity is not None else CapacityInputs.of(spec).planned(),
            deployment_dir=DeploymentPaths.of(spec).deployment_dir, root=workspace_root(acceptance, train, nightly),
        )  # fmt: skip


class DrillsInputs(BaseModel):
    """The drills step: where their jobs run (cluster, image, job environment), the job they drill, the acceptance
    section (job timeout, steps, checkpoint interval), the drills' settings, the run workspace whose drills/ folder
    they run in, and which drills."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cluster: ClusterConfig
    train: TrainConfig
    acceptance: AcceptanceConfig
    drills: DrillConfig | None = None
    """The drills' settings; None: the defaults."""
    image: str | None = None
    """The image reference the drill jobs run in (None: the nodes' own environment)."""
    environment: JobEnvironment | None = None
    """Variables the drill jobs get beside cluster.env (tasks/launch/environment.py): the tests', never a spec's."""
    root: str
    """The run workspace: the acceptance step's (its uninterrupted run and rank_kill drill are reused), or a new one."""
    only: tuple[str, ...] | None = None
    """The drills to run (None: drills.only, else every one)."""

    @classmethod
    def of(
        cls,
        spec: DeploymentSpec,
        train: TrainConfig,
        *,
        accepted: AcceptanceResult | None = None,
        image: str | None = None,
        only: list[str] | None = None,
        work_url: str | None = None,
        environment: JobEnvironment | None = None,
    ) -> DrillsInputs:
        """The drills of `train` by `spec` in the workspace of the acceptance step's result `accepted` (None: a new
        run workspace under acceptance.work_url, or `work_url`), in the image reference `image`."""
        acceptance = _acceptance_section(spec, work_url)
        return cls(
            cluster=spec.cluster, train=train, acceptance=acceptance, drills=spec.drills, image=image,
            environment=environment, root=accepted.root if accepted is not None else workspace_root(acceptance, train),
            only=tuple(only) if only is not None else None,
        )  # fmt: skip


def _finish(report: AcceptanceReport, workspace: Workspace, drills: bool, publish: Publish | None) -> AcceptanceResult:
    """Write the report's files, hand them to `publish`, point latest.json at the workspace; the step's result, or
    AcceptanceFailed naming the failed findings."""
    folder = workspace.drills if drills else workspace.root
    files = write_files(report, folder)
    if publish is not None:
        publish(report, files)
    latest = str(mark_latest(workspace))
    data = report.to_json()
    result = AcceptanceResult(verdict_text=data["verdict"], files=files, report=data, root=str(folder), latest=latest)
    if drills and report.failed:
        raise AcceptanceFailed(f"drills failed: {', '.join(report.failed)}", f"see {files['json']}")
    if not drills and not report.passed:
        unmeasured = f" (not measured: {', '.join(report.not_measured)})" if report.not_measured else ""
        raise AcceptanceFailed(f"acceptance failed: {', '.join(report.failed)}{unmeasured}", f"see {files['json']}")
    return result


def run(inputs: AcceptanceStepInputs, publish: Publish | None = None) -> AcceptanceResult:
    """Empty the run workspace, run the suite in it (`run_acceptance`), write its reports and hand them to
    `publish`; AcceptanceFailed when a dimension (the regression gate included) or a drill failed."""
    workspace = open_workspace(inputs.root, inputs.acceptance.keep_runs)
    log.info("acceptance workspace %s", workspace.root)
    return _finish(run_acceptance(inputs, workspace.root), workspace, False, publish)


def run_drills(
    inputs: DrillsInputs,
    publish: Publish | None = None,
    on_result: Callable[[DrillResult], None] | None = None,
) -> AcceptanceResult:
    """Empty the workspace's drills/ folder, run the drills there (`run_drill_suite`, reusing what an acceptance run
    left in the workspace), each drill's result to `on_result`; write their reports and hand them to `publish`;
    AcceptanceFailed when a drill failed."""
    workspace = open_workspace(inputs.root, inputs.acceptance.keep_runs, "drills")
    log.info("drills workspace %s", workspace.drills)
    only = list(inputs.only) if inputs.only is not None else None
    return _finish(run_drill_suite(inputs, workspace.root, only, on_result), workspace, True, publish)
