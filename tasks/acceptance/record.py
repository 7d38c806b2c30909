"""acceptance.json: the acceptance report's typed record, its writer and its reader.

The one module that spells the file's name. It stays cheap to import (no torch, no launchers): the diagnosis and
the ledger read reports without loading the acceptance suite.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.errors import UserError
from tasks.export.readme import AcceptanceFigures
from training.run_output import DistillationRecord
from validation.acceptance import DimensionResult
from validation.goodput import GoodputField
from validation.plan_accuracy import PlanAccuracy


log = logging.getLogger(__name__)

ACCEPTANCE_JSON = "acceptance.json"
"""The report's file name in a run workspace (or its drills/ folder)."""


@dataclass
class DrillResult:
    """What a drill found."""

    name: str
    passed: bool | None
    recovery_s: float | None = None
    detection_s: float | None = None
    """From the fault to the job noticing it (node_loss: a new rendezvous, or the job's end)."""
    steps_lost: int | None = None
    state_matched: bool | None = None
    message: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As a dict."""
        return asdict(self)


class UnreadableReport(UserError):
    """A path that holds no acceptance report the writer wrote (missing, not JSON, or other fields)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            f"{path}: not an acceptance report ({problem})",
            "pass an acceptance run workspace (runs/<name>/acceptance/<run-id>) whose acceptance step finished",
        )
        self.path, self.problem = path, problem


class AcceptanceReport(BaseModel):
    """Every dimension and drill, and the overall verdict."""

    model_config = ConfigDict(extra="forbid")

    dimensions: list[DimensionResult] = Field(description="The dimensions' verdicts, in report order.")
    drills: list[DrillResult] = Field(default_factory=list, description="The drills' findings, in the order run.")
    runs: dict[str, str] = Field(
        default_factory=dict, description="Output folder of each run by role (distributed, reference, correctness)."
    )
    ledger_entry: str | None = Field(
        default=None,
        description="The ledger entry this accepted run recorded (None: not accepted, or the ledger could not be "
        "written).",
    )
    plan_accuracy: PlanAccuracy | None = Field(
        default=None,
        description="The capacity plan beside what the distributed run measured (None: no plan given, or no steps).",
    )
    goodput: GoodputField | None = Field(
        default=None,
        description="The distributed run's allocation split into productive time and badput by kind (None: its "
        "records do not give it, or reports from before goodput).",
    )
    distillation: DistillationRecord | None = Field(
        default=None,
        description="A distill run's student beside its teacher (the distributed run's distillation.json; None: not "
        "a distill run).",
    )

    @model_validator(mode="before")
    @classmethod
    def _without_derived(cls, data: Any) -> Any:
        """A written report less what `to_json` derives (verdict, each dimension's status, the plan's errors)."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k != "verdict"}
        if isinstance(data.get("dimensions"), list):
            data["dimensions"] = [
                {k: v for k, v in d.items() if k != "status"} if isinstance(d, dict) else d for d in data["dimensions"]
            ]
        if isinstance(data.get("plan_accuracy"), dict):
            data["plan_accuracy"] = {k: v for k, v in data["plan_accuracy"].items() if k in PlanAccuracy.model_fields}
        return data

    @property
    def passed(self) -> bool:
        """All dimensions passed (one not measured has not) and no drill failed (a drill that does not apply is
        not a failure)."""
        return all(d.passed is True for d in self.dimensions) and all(d.passed is not False for d in self.drills)

    @property
    def failed(self) -> list[str]:
        """The names of the findings that failed (not those that could not be measured)."""
        return [d.name for d in self.dimensions if d.passed is False] + [
            d.name for d in self.drills if d.passed is False
        ]

    @property
    def not_measured(self) -> list[str]:
        """The dimensions that could not be measured."""
        return [d.name for d in self.dimensions if d.passed is None]

    def to_json(self) -> dict[str, Any]:
        """The file's content: the fields, the verdict and what each record derives."""
        return {
            "verdict": "passed" if self.passed else "failed",
            "dimensions": [d.to_json() for d in self.dimensions],
            "drills": [d.to_json() for d in self.drills],
            "runs": self.runs,
            "ledger_entry": self.ledger_entry,
            "plan_accuracy": self.plan_accuracy.to_json() if self.plan_accuracy else None,
            "goodput": self.goodput.to_json() if self.goodput else None,
            "distillation": asdict(self.distillation) if self.distillation else None,
        }

    @staticmethod
    def path_in(folder: Path) -> Path:
        """Where the report of the run workspace (or drills folder) `folder` is."""
        return Path(folder) / ACCEPTANCE_JSON

    def write(self, folder: Path) -> Path:
        """Write the report into `folder` (created if missing); its path."""
        path = self.path_in(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, default=str))
        return path

    @classmethod
    def read(cls, folder_or_file: Path) -> AcceptanceReport:
        """The report in a run workspace (or drills folder), or in the file itself; UnreadableReport when there
        is none or it is not what `write` writes."""
        path = Path(folder_or_file)
        path = cls.path_in(path) if path.is_dir() else path
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, ValueError) as err:  # ValidationError and JSONDecodeError are ValueErrors
            problem = str(err).splitlines()[0] if not isinstance(err, ValidationError) else _first_error(err)
            raise UnreadableReport(path, f"{type(err).__name__}: {problem}") from err


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']} ({err.error_count()} problem(s))"


def latest_card(workspaces: Path) -> AcceptanceFigures | None:
    """The model card's view of the last acceptance report under `workspaces` (tasks.paths
    DeploymentPaths.acceptance_workspaces; None before the first; an unreadable one is logged and left out)."""
    from tasks.acceptance.workspace import latest_run  # noqa: PLC0415 - loads the launchers; a report reader does not

    root = latest_run(workspaces)
    if root is None:
        return None
    try:
        return AcceptanceFigures.of(AcceptanceReport.read(root))
    except UnreadableReport as err:
        log.warning("the model card leaves the acceptance figures out: %s", err)
        return None
