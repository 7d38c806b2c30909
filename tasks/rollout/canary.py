"""Canary rollout: a new image runs a short acceptance on a few nodes first, held to the baseline by the
regression gate; only a passing canary lets it run on the whole deployment.

The canary's baseline is the ledger's current entry of the canary's own shape (cluster identity: its node
count). Where there is none yet, the current version (the whole deployment's current baseline's image) runs
the same canary first and is recorded as that shape's baseline, so the new version is always compared with
the version it replaces on the same nodes. A failing canary raises RolloutStopped with the failed figures:
nothing else runs and the current version stays in place (its baseline unchanged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.record import AcceptanceReport
from tasks.acceptance.mode import Mode
from tasks.acceptance.step import AcceptanceStepInputs
from tasks.acceptance.suite import AcceptanceInputs, run_acceptance
from tasks.acceptance.workspace import new_run_id, open_workspace
from tasks.errors import UserError
from tasks.image.config import image_reference
from tasks.launch.base import TERMINAL, JobState
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.submit import JobFailed, submit
from tasks.ledger.registry import Ledger, Provenance, cluster_key_of
from tasks.paths import DeploymentPaths, ledger_url, workspace_base
from training.config import TrainConfig

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

log = logging.getLogger(__name__)

CANARY_DIR = "canary"
"""Beside the run workspaces: the canaries' own workspaces (pruned by acceptance.keep_runs like the others)."""
ARTIFACT = "canary"


class CanaryInputs(BaseModel):
    """The canary of a new image: the deployment's name, cluster, training config and acceptance section, the
    image, and the deployment's folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    cluster: ClusterConfig
    train: TrainConfig
    acceptance: AcceptanceConfig
    image: str
    """The new version's image reference."""
    deployment_dir: str
    """The deployment's folder (tasks.paths), recorded in the quality baseline a canary of the current version
    writes."""
    environment: JobEnvironment | None = None
    """Variables the new version's jobs get beside cluster.env (a test's slower version), not the current one's."""

    @classmethod
    def of(
        cls, spec: DeploymentSpec, train: TrainConfig, *, image: str, environment: JobEnvironment | None = None
    ) -> CanaryInputs:
        """The canary of `image` for `spec`'s deployment (`train`: data_and_training's)."""
        return cls(
            name=spec.name, cluster=spec.cluster, train=train, acceptance=spec.acceptance, image=image,
            deployment_dir=DeploymentPaths.of(spec).deployment_dir, environment=environment,
        )  # fmt: skip


class RolloutStopped(UserError):
    """The canary failed: the new version does not run on the whole deployment; the reason names the figures."""

    def __init__(self, image: str, reasons: list[str], report: str) -> None:
        super().__init__(
            f"rollout of {image} stopped at the canary; the current version stays in place: {'; '.join(reasons)}",
            f"see {report}; fix the new version, or roll out another image",
        )
        self.image, self.reasons = image, reasons


@dataclass(frozen=True)
class CanaryOutcome:
    """A canary that passed: its report, workspace, and the entry it was compared with."""

    report: AcceptanceReport
    root: Path
    baseline_entry: str | None


def canary_cluster(cluster: ClusterConfig, acceptance: AcceptanceConfig) -> ClusterConfig:
    """The canary's cluster: acceptance.canary.nodes of the deployment's nodes."""
    nodes = acceptance.canary.nodes
    if nodes > cluster.nodes:
        raise UserError(
            f"acceptance.canary.nodes={nodes} exceeds cluster.nodes={cluster.nodes}",
            f"use at most {cluster.nodes} canary node(s)",
        )
    return cluster.model_copy(update={"nodes": nodes, "min_nodes": None})


def _canary_acceptance(acceptance: AcceptanceConfig, train: TrainConfig) -> AcceptanceConfig:
    base = workspace_base(acceptance.work_url, train.run.output_url)
    steps = acceptance.canary.steps or acceptance.steps
    return acceptance.model_copy(
        update={
            "steps": steps,
            "save_every_steps": min(acceptance.save_every_steps, steps),
            "reference_steps": min(acceptance.reference_steps, steps),
            "soak_steps": None,
            "work_url": str(base / CANARY_DIR),
            "ledger_url": ledger_url(acceptance, train.run.output_url),
        }
    )


def _failures(report: AcceptanceReport) -> list[str]:
    found = [f"{d.name}: {d.message}" for d in report.dimensions if d.passed is False]
    found += [f"{d.name}: not measured ({d.message})" for d in report.dimensions if d.passed is None]
    return found


def run_canary(inputs: CanaryInputs) -> CanaryOutcome:
    """Run `inputs.image` on the canary and hold it to the canary shape's baseline; RolloutStopped when it fails.
    `inputs.environment` reaches the new version's jobs only (a test's slower version), not the current one's."""
    spec_name, cluster, train, acceptance = inputs.name, inputs.cluster, inputs.train, inputs.acceptance
    image, environment = inputs.image, inputs.environment
    try:
        image_reference(image, "registry.example/tdeploy:2026-01")
    except ValueError as err:
        raise UserError(f"image {err}", "pass the new version's image reference") from err
    small = canary_cluster(cluster, acceptance)
    canary_acceptance = _canary_acceptance(acceptance, train)
    ledger = Ledger(canary_acceptance.ledger_url or "", train.storage)
    base = Path(canary_acceptance.work_url or "")

    def accept(
        version: str | None, extra: JobEnvironment | None, record: bool
    ) -> tuple[AcceptanceReport, Path]:
        root = open_workspace(base / new_run_id(), acceptance.keep_runs).root
        provenance = Provenance(spec_name, None, version)
        suite = AcceptanceInputs(
            cluster=small, train=train, acceptance=canary_acceptance, mode=Mode.CANARY, image=version,
            environment=extra, provenance=provenance, record=record, deployment_dir=inputs.deployment_dir,
        )  # fmt: skip
        report = run_acceptance(suite, root)
        return report, root

    whole = ledger.current(spec_name, cluster_key_of(cluster))
    current_image = whole.image_ref if whole is not None else None
    if whole is None:
        log.warning("no baseline of %s yet: the canary has nothing to be held to", spec_name)
    elif cluster_key_of(small) != whole.cluster_key:
        shaped = ledger.current(spec_name, cluster_key_of(small))
        if shaped is None or shaped.image_ref != current_image:
            log.info("no canary baseline of the current version on %d node(s): running it (%s) there first",
                     small.nodes, current_image or "the nodes' own environment")  # fmt: skip
            first, root = accept(current_image, None, record=True)
            if not first.passed:
                reasons = ["the current version itself failed the canary: " + "; ".join(_failures(first))]
                raise RolloutStopped(image, reasons, str(AcceptanceReport.path_in(root)))
    report, root = accept(image, environment, record=False)
    regression = next(d for d in report.dimensions if d.name == "regression")
    if not report.passed:
        raise RolloutStopped(image, _failures(report), str(AcceptanceReport.path_in(root)))
    return CanaryOutcome(report, root, regression.evidence.get("baseline_entry"))


def rollout_acceptance(
    spec: DeploymentSpec, train: TrainConfig, image: str, environment: JobEnvironment | None = None
) -> AcceptanceStepInputs:
    """The whole deployment's acceptance of `image` after its canary (`tdeploy rollout` and the rollout flow): the
    acceptance step's inputs, with the image as provenance and the capacity plan's figures."""
    return AcceptanceStepInputs.of(spec, train, image=image, environment=environment)


@dataclass(frozen=True)
class RolloutOutcome:
    """A rollout that went through: the canary, the whole deployment's acceptance (its new ledger entry), the job."""

    canary: CanaryOutcome
    acceptance: AcceptanceReport
    job: str
    state: str


def roll_out(
    spec: DeploymentSpec,
    train: TrainConfig,
    image: str,
    until: Literal["submitted", "running", "finished"] = "running",
    environment: JobEnvironment | None = None,
) -> RolloutOutcome:
    """The canary, then acceptance on the whole deployment (the regression gate against its baseline; accepted,
    it records the new version's entry), then the training job with `image`; each failure stops the rollout with
    the current version in place (`tdeploy rollout`; the rollout flow composes the same steps as tasks)."""
    canary = run_canary(CanaryInputs.of(spec, train, image=image, environment=environment))
    inputs = rollout_acceptance(spec, train, image, environment)
    root = open_workspace(inputs.root, spec.acceptance.keep_runs).root
    report = run_acceptance(inputs, root)
    if not report.passed:
        raise RolloutStopped(image, _failures(report), str(AcceptanceReport.path_in(root)))
    launcher, handle = submit(spec.cluster, train, spec.name, image, supervised=until == "finished")
    states = {"submitted": frozenset(JobState), "running": frozenset({JobState.RUNNING}), "finished": TERMINAL}
    status = launcher.wait(handle, states[until])
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        raise JobFailed(handle, status)
    return RolloutOutcome(canary, report, handle.ref, status.state.value)
