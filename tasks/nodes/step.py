"""The node-check step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tasks.launch.cluster import ClusterConfig
from tasks.nodes.check import raise_for_blocking, run_node_checks
from tasks.nodes.config import NodesConfig
from tasks.nodes.report import NodeReport
from tasks.paths import DeploymentPaths
from tasks.results import Figure, StepResult

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

TITLE = "node environment checks"
ARTIFACT = "node-checks"


class NodesInputs(BaseModel):
    """What the node checks read: the nodes and cluster sections, and where node-check.json goes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    nodes: NodesConfig
    cluster: ClusterConfig
    report_path: str

    @classmethod
    def of(cls, spec: DeploymentSpec, folder: str | None = None) -> NodesInputs:
        """The node checks of `spec`, node-check.json in `folder` (default: the deployment's reports folder)."""
        return cls(nodes=spec.nodes, cluster=spec.cluster, report_path=DeploymentPaths.of(spec).node_report(folder))


class NodesResult(StepResult):
    """The node checks' outcome (blocking findings fail the step instead)."""

    ok: bool
    hosts: list[str]
    warnings: int
    report_path: str
    elapsed_s: float

    @classmethod
    def of(cls, report: NodeReport, report_path: str) -> NodesResult:
        """The result of a written node report."""
        return cls(
            ok=report.ok,
            hosts=list(report.hosts),
            warnings=len(report.warnings),
            report_path=report_path,
            elapsed_s=round(report.elapsed_s, 3),
        )

    def figures(self) -> dict[str, Figure]:
        """Hosts checked, warnings, seconds and where the report is."""
        return {"hosts": len(self.hosts), "warnings": self.warnings, "elapsed_s": self.elapsed_s,
                "report_path": self.report_path}  # fmt: skip

    def summary(self) -> str:
        """Hosts, warnings and where the report is."""
        return f"{len(self.hosts)} host(s), {self.warnings} warning(s); `{self.report_path}`"


def run(
    inputs: NodesInputs, publish: Callable[[NodeReport, Path], None] | None = None, retries_left: int = 0
) -> NodesResult:
    """Check the nodes, write node-check.json, hand the report to `publish`; NodeCheckFailed (or NodesUnreachable,
    which a retry may clear) on blocking findings."""
    report = run_node_checks(inputs.nodes, inputs.cluster)
    path = report.write(inputs.report_path)
    if publish is not None:
        publish(report, path)
    raise_for_blocking(report, path, retries_left)
    return NodesResult.of(report, str(path))
