"""plan.json, the capacity plan's file: written by tasks.capacity.plan.write_plan, read back typed by `read_plan`.

Light on purpose (pydantic and fsspec only): the diagnosis and the capacity step's cache check read a plan
without loading the planner.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.errors import UserError
from training.storage import StorageConfig, filesystem


class PlannedLayout(BaseModel):
    """One evaluated layout as plan.json holds it: its name, degrees and whether and how it fits."""

    model_config = ConfigDict(extra="ignore")  # plan.json holds more figures than its readers use

    layout: dict[str, Any] = Field(description="The layout's degrees and batching (Layout's fields) and its `name`.")
    fits: bool = Field(description="Whether it fits the device's usable memory.")
    memory: dict[str, Any] = Field(description="Peak memory per device by component, in bytes (`total_bytes`).")
    usable_bytes: float = Field(description="Device memory less the headroom, in bytes.")
    step_seconds: float = Field(description="Planned seconds per optimizer step.")
    why: list[str] = Field(default_factory=list, description="Why it ranks where it does (the search's layouts).")

    @property
    def name(self) -> str:
        """The layout's short name (Layout.describe())."""
        return str(self.layout["name"])

    @property
    def peak_bytes(self) -> float:
        """Its planned peak per device."""
        return float(self.memory["total_bytes"])


class PlanSearch(BaseModel):
    """The search's part of plan.json: how many layouts it weighed and the fitting ones, fastest first."""

    model_config = ConfigDict(extra="ignore")

    evaluated_layouts: int = Field(description="Layouts evaluated.")
    fitting_layouts: int = Field(description="Layouts that fit.")
    best: list[PlannedLayout] = Field(description="The fastest fitting layouts, fastest first.")


class PlanRecord(BaseModel):
    """plan.json read back (CapacityPlan.to_json()): what its readers use, typed; every figure stays in `raw`."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="The deployment's name.")
    fits: bool = Field(description="Whether the requested layout fits (device and host memory).")
    requested: PlannedLayout = Field(description="The spec's own layout.")
    search: PlanSearch = Field(description="The layouts the search found.")
    self_check: list[dict[str, Any]] = Field(default_factory=list, description="Measurements against the plan.")
    raw: dict[str, Any] = Field(default_factory=dict, exclude=True, description="The whole file, every figure.")

    def fitting(self) -> list[str]:
        """The names of the fitting layouts the search lists, fastest first."""
        return [b.name for b in self.search.best if b.fits]


class UnreadablePlan(UserError):
    """A URL that holds no plan.json as write_plan writes it (missing, not JSON, or other fields)."""

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(
            f"{url}: not a capacity plan ({problem})",
            "run `tdeploy plan SPEC` (or the deployment's capacity step) to write it again",
        )
        self.url, self.problem = url, problem


def read_plan(url: str, storage: StorageConfig | None = None) -> PlanRecord:
    """plan.json at `url` as write_plan wrote it; UnreadablePlan names the file and what is wrong with it."""
    fs, path = filesystem(url, storage)
    try:
        text = fs.cat_file(path)
    except FileNotFoundError:
        raise UnreadablePlan(url, "no such file") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise UnreadablePlan(url, f"not JSON: {err}") from None
    try:
        return PlanRecord.model_validate(data).model_copy(update={"raw": data})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:3])
        raise UnreadablePlan(url, problems) from None


def write_plan_file(url: str, data: dict[str, Any]) -> None:
    """Write `data` (CapacityPlan.to_json()) as plan.json at `url`, creating its folder."""
    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as handle:
        json.dump(data, handle, indent=2)
