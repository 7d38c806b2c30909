"""Every path and URL of a deployment, derived from its spec here and nowhere else.

`derived_paths` fills in a spec's deployment_dir (runs/<name> by default) and the folders it implies
(run.output_url, checkpoint.url, data.prepare.output_url, capacity.output_url, acceptance.work_url) before the
spec is validated; the rest of this module derives what lies under them: plan.json, node-check.json, the image
record, the serving and export folders, the acceptance run workspaces, the ledger, and the folders of adopted
datasets and of the token suite's verdicts. Functions take only the sub-configs
they read, so that a step that is handed its own section can derive its paths without the whole spec.

Importing this module loads neither Prefect nor torch, and of `tasks/` it imports only tasks/names.py at run time:
every step package can import it (training.storage, which it joins URLs with, loads neither).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.names import NAME_PATTERN
from training.storage import join

if TYPE_CHECKING:
    from tasks.acceptance.config import AcceptanceConfig
    from tasks.capacity.config import CapacityConfig
    from tasks.spec import DeploymentSpec
    from training.config import TrainConfig

RUNS_DIR = "runs"
"""Deployment folders go under runs/<name>/ (relative to where tdeploy runs) unless deployment_dir says otherwise."""
UNNAMED = "unnamed"
"""Stands in for an invalid name while deriving paths, so the spec fails on the name alone."""
PLAN_JSON = "plan.json"
NODE_REPORT = "node-check.json"
IMAGE_DIR = "image"
EXPORT_DIR = "export"
SERVING_DIR = "serving"
QUANTIZE_DIR = "quantize"
EXPORT_RECORD = "EXPORT.json"
"""Written last into an exported model folder (tasks/export/step.py): its presence means the export is finished."""
QUANTIZE_RECORD = "QUANTIZE.json"
"""Written last into a quantized model folder (tasks/quantize/quantizer.py), naming its source export."""
"""quantization.json, the servers' logs and load tests of the quantize step, in the deployment's reports folder."""
ACCEPTANCE_DIR = "acceptance"
NIGHTLY_DIR = "nightly"
LEDGER_DIR = "ledger"
NODES_DIR = "nodes"
"""The node memory (tasks/recovery/quarantine.py: host failures and quarantines) inside the deployment's ledger."""
EXPOSURE_DIR = "exposure"
"""Node-hours and failures of the deployment's jobs (tasks/recovery/exposure.py) inside its ledger."""
BASELINES_DIR = "baselines"
DATASETS_DIR = "datasets"
DATA_VALIDATION_DIR = "data-validation"
"""Folder of the given datasets' validations in the deployment's reports folder: one sub-folder per verdict key."""


def derived_paths(data: dict[str, Any]) -> dict[str, Any]:
    """Raw spec data with every path the deployment's folder implies filled in where the spec omits it.

    The folder is deployment_dir, else runs/<name>: run.output_url (output/), checkpoint.url (checkpoints/),
    data.prepare.output_url (datasets/), capacity.output_url (plan.json) and acceptance.work_url (acceptance/).
    """
    name = data.get("name")
    folder = data.get("deployment_dir")
    if folder is None:
        valid = isinstance(name, str) and re.fullmatch(NAME_PATTERN, name) is not None
        folder = f"{RUNS_DIR}/{name if valid else UNNAMED}"
    if not isinstance(folder, str):
        return data  # the field's own validation reports it
    base = folder.rstrip("/")
    out = {**data, "deployment_dir": folder}
    targets = [
        ("run", "output_url", f"{base}/output", False),
        ("checkpoint", "url", f"{base}/checkpoints", False),
        ("capacity", "output_url", base, True),
        ("acceptance", "work_url", f"{base}/acceptance", True),
    ]
    for section, key, value, optional_section in targets:
        current = out.get(section, {} if optional_section else None)
        if isinstance(current, dict) and current.get(key) is None:
            out[section] = {**current, key: value}
    data_section = out.get("data")
    if isinstance(data_section, dict) and isinstance(data_section.get("prepare"), dict):
        prepare = data_section["prepare"]
        if prepare.get("output_url") is None:
            out["data"] = {**data_section, "prepare": {**prepare, "output_url": f"{base}/{DATASETS_DIR}"}}
    return out


def _under(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def plan_location(name: str, capacity: CapacityConfig, folder: str | None = None) -> str:
    """Where plan.json goes: `folder`, else capacity.output_url (a spec sets it to its deployment_dir,
    runs/<name>), else runs/<name>."""
    return _under(folder or capacity.output_url or f"{RUNS_DIR}/{name}", PLAN_JSON)


def workspace_base(work_url: str | None, output_url: str, nightly: bool = False) -> Path:
    """Where acceptance run workspaces go: acceptance.work_url (the spec sets it to <deployment_dir>/acceptance),
    else 'acceptance' beside run.output_url (an AcceptanceConfig used on its own); the nightly runs under nightly/."""
    if work_url:
        base = Path(work_url.removeprefix("file://")).resolve()
    else:
        base = Path(output_url.removeprefix("file://")).resolve().parent / ACCEPTANCE_DIR
    return base / NIGHTLY_DIR if nightly else base


def ledger_url(acceptance: AcceptanceConfig, output_url: str) -> str:
    """The spec's ledger (`output_url`: its run.output_url): acceptance.ledger_url, else `ledger/` beside its
    (non-nightly) run workspaces."""
    return acceptance.ledger_url or str(workspace_base(acceptance.work_url, output_url) / LEDGER_DIR)


def baselines_dir(acceptance: AcceptanceConfig, output_url: str) -> Path:
    """The quality baselines' folder (`output_url`: the spec's run.output_url): `baselines/` beside its (non-nightly)
    run workspaces, shared by the nightly runs."""
    return workspace_base(acceptance.work_url, output_url) / BASELINES_DIR


def default_export_root(train: TrainConfig) -> str:
    """Exports of a training config alone: `export` beside checkpoint.url (runs/<name>/export for a spec's default
    checkpoint folder)."""
    parent = train.checkpoint.url.rstrip("/").rpartition("/")[0]
    return join(parent or ".", EXPORT_DIR)


def adopted_root(adopted_url: str | None, reports_dir: str) -> str:
    """Where adoptions of data.dataset_url / data.blend go: data.adopted_url, else <reports>/datasets."""
    return adopted_url or join(reports_dir, DATASETS_DIR)


def data_validation_dir(reports_dir: str, key: str) -> Path:
    """The token suite's report and verdict of one check of a given dataset (`key`: the check's verdict key)."""
    return Path(reports_dir) / DATA_VALIDATION_DIR / key


@dataclass(frozen=True)
class DeploymentPaths:
    """The files and folders of one deployment, from its spec (`DeploymentPaths.of`)."""

    name: str
    reports_dir: str
    """deployment_dir without its file:// scheme: plan.json, node-check.json, image/, serving/, export/."""
    capacity: CapacityConfig
    acceptance: AcceptanceConfig
    output_url: str
    """run.output_url: where the acceptance workspaces and the ledger go when acceptance.work_url is unset."""

    @classmethod
    def of(cls, spec: DeploymentSpec) -> DeploymentPaths:
        """The paths of `spec`'s deployment."""
        return cls(spec.name, spec.reports_dir, spec.capacity, spec.acceptance, spec.run.output_url)

    def plan_url(self, folder: str | None = None) -> str:
        """plan.json: in `folder`, else capacity.output_url (the deployment's reports folder by default)."""
        return plan_location(self.name, self.capacity, folder)

    def node_report(self, folder: str | None = None) -> str:
        """node-check.json: in `folder`, else in the deployment's reports folder."""
        return _under(folder or self.reports_dir, NODE_REPORT)

    def image_dir(self, folder: str | None = None) -> str:
        """image.json and the build context: `folder`, else <reports>/image."""
        return folder or _under(self.reports_dir, IMAGE_DIR)

    def serving_dir(self, folder: str | None = None) -> str:
        """serving.json, the server's log and the manifests: `folder`, else <reports>/serving."""
        return folder or _under(self.reports_dir, SERVING_DIR)

    def quantize_dir(self, folder: str | None = None) -> str:
        """quantization.json, quantize.log and both models' serving figures: `folder`, else <reports>/quantize."""
        return folder or _under(self.reports_dir, QUANTIZE_DIR)

    @property
    def deployment_dir(self) -> str:
        """The deployment's folder as an absolute path (what a quality baseline records it ran under)."""
        return str(Path(self.reports_dir).resolve())

    @property
    def export_dir(self) -> str:
        """The folder exports go under, one step-<N>/ each: <reports>/export."""
        return _under(self.reports_dir, EXPORT_DIR)

    @property
    def acceptance_workspaces(self) -> Path:
        """The folder of the deployment's acceptance run workspaces and their latest.json."""
        return workspace_base(self.acceptance.work_url, self.output_url)

    @property
    def ledger_url(self) -> str:
        """The deployment's ledger (see `ledger_url`)."""
        return ledger_url(self.acceptance, self.output_url)

    @property
    def node_memory_url(self) -> str:
        """The deployment's node memory: which hosts failed and which are quarantined (<ledger>/nodes)."""
        return join(self.ledger_url, NODES_DIR)

    @property
    def health_gate_baseline_url(self) -> str:
        """The compute rates the deployment's health gates measured on healthy nodes
        (<ledger>/health_gate_baseline.json, tasks/launch/health_gate.py): what a lone node is judged against."""
        return join(self.ledger_url, "health_gate_baseline.json")

    @property
    def exposure_url(self) -> str:
        """Node-hours and failures of the deployment's jobs, its observed failure rate (<ledger>/exposure)."""
        return join(self.ledger_url, EXPOSURE_DIR)

    def workspace_base(self, nightly: bool = False) -> Path:
        """Where the acceptance run workspaces go (see `workspace_base`)."""
        return workspace_base(self.acceptance.work_url, self.output_url, nightly)
