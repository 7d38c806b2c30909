"""The consistency report: one row per check with the value on each host, severities and remediation.

Drift is judged against the reference value (the one most hosts have; on a tie, the first host's).
Blocking: the job cannot start or will hang (different torch/CUDA/NCCL/driver major version, missing
GPU, closed rendezvous port, unreachable host, ...). Warning: worth fixing, the job still runs
(kernel patch level, OS point release, ...). The rows come from the drift table (tasks/nodes/drift.py)
and the per-host checks (tasks/nodes/status.py); this module holds what they produce and how it is shown.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import TypeAdapter, ValidationError

from tasks.nodes.facts import HostReport, NodeFacts, host_reports

if TYPE_CHECKING:  # the report is read (diagnosis) where Ansible is not needed
    from tasks.nodes.inventory import CheckPlan
    from tasks.nodes.runner import PlaybookRun

Severity = Literal["ok", "warning", "blocking"]
RANK = {"ok": 0, "warning": 1, "blocking": 2}
ABSENT = "absent"
NO_RESULT = "-"


@dataclass
class Row:
    """One check across the hosts: each host's value, and what is wrong and how to fix it, if anything."""

    check: str
    values: dict[str, str]
    severity: Severity = "ok"
    finding: str | None = None
    remediation: str | None = None
    hosts: list[str] = field(default_factory=list)
    transient: bool = False


@dataclass(frozen=True)
class Finding:
    """What is wrong in one row: how bad, on which hosts, and the fix."""

    severity: Severity
    hosts: list[str]
    finding: str
    remediation: str


def flag(row: Row, finding: Finding | None) -> Row:
    """`row` with the finding's severity, hosts, text and fix set (unchanged when there is no finding)."""
    if finding is not None:
        row.severity, row.hosts = finding.severity, list(finding.hosts)
        row.finding, row.remediation = finding.finding, finding.remediation
    return row


def host_list(hosts: list[str]) -> str:
    """`a, b, c`, the first ten hosts and how many more."""
    return ", ".join(hosts[:10]) + (f" and {len(hosts) - 10} more" if len(hosts) > 10 else "")


@dataclass(frozen=True)
class Observed:
    """One playbook run as the checks read it: the plan, the hosts in order, and what the roles reported."""

    run: PlaybookRun
    plan: CheckPlan
    reports: dict[str, HostReport]

    @classmethod
    def of(cls, run: PlaybookRun, plan: CheckPlan) -> Observed:
        """The typed view of a run (the roles' data is validated here)."""
        return cls(run, plan, host_reports(run.results))

    @property
    def order(self) -> list[str]:
        return self.run.hosts

    @cached_property
    def facts(self) -> dict[str, NodeFacts]:
        """The facts of each host that reported them, in host order."""
        return {h: r.facts for h in self.order if (r := self.reports.get(h)) is not None and r.facts is not None}

    @property
    def reached(self) -> list[str]:
        """The hosts that reported their facts, in host order."""
        return list(self.facts)


class UnreadableNodeReport(ValueError):
    """node-check.json that is not a report `NodeReport.write` wrote."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}; run `tdeploy check-nodes SPEC` again to rewrite it")
        self.path, self.problem = path, problem


@dataclass
class NodeReport:
    """The result of one node check; `write` and `read` own its file, node-check.json (log beside it)."""

    hosts: list[str]
    rows: list[Row]
    elapsed_s: float
    run_status: str
    log: str = ""

    @property
    def blocking(self) -> list[Row]:
        return [r for r in self.rows if r.severity == "blocking"]

    @property
    def warnings(self) -> list[Row]:
        return [r for r in self.rows if r.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.blocking

    @property
    def blocking_hosts(self) -> list[str]:
        named = {h for r in self.blocking for h in r.hosts}
        return [h for h in self.hosts if h in named]

    def row(self, check: str) -> Row:
        """The row of a check, by name."""
        return next(r for r in self.rows if r.check == check)

    def summary(self) -> str:
        """One line for logs and the artifact description."""
        verdict = "ready" if self.ok else f"NOT ready (blocking on {', '.join(self.blocking_hosts) or 'all'})"
        return (
            f"{len(self.hosts)} node(s) {verdict}: {len(self.blocking)} blocking, {len(self.warnings)} warning(s); "
            f"checked in {self.elapsed_s:.1f} s"
        )

    def to_json(self) -> dict[str, Any]:
        """The machine-readable report."""
        return {
            "ok": self.ok,
            "summary": self.summary(),
            "hosts": self.hosts,
            "blocking_hosts": self.blocking_hosts,
            "elapsed_s": round(self.elapsed_s, 3),
            "run_status": self.run_status,
            "rows": [asdict(r) for r in self.rows],
        }

    def write(self, path: str | Path) -> Path:
        """Write the JSON report to `path`, and the playbook's output beside it (`.log`); the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        path.with_suffix(".log").write_text(self.log)
        return path

    @classmethod
    def read(cls, path: str | Path) -> NodeReport:
        """The report `write` wrote at `path`, with its log where it is still there; UnreadableNodeReport naming
        the file and what is wrong otherwise."""
        path = Path(path)
        try:
            data = _REPORT_FILE.validate_json(path.read_bytes())
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "<report>"
            raise UnreadableNodeReport(path, f"{where}: {first['msg']}") from err
        log = path.with_suffix(".log")
        return cls(
            hosts=data.hosts,
            rows=data.rows,
            elapsed_s=data.elapsed_s,
            run_status=data.run_status,
            log=log.read_text(errors="replace") if log.is_file() else "",
        )

    def table(self, max_chars: int = 400) -> list[dict[str, str]]:
        """Rows for a table artifact: values grouped as `value (hosts)` so that it stays readable at 1,000 nodes."""
        return [
            {
                "check": r.check,
                "severity": r.severity,
                "values": grouped_values(r.values, max_chars),
                "finding": r.finding or "",
                "remediation": r.remediation or "",
            }
            for r in self.rows
        ]


@dataclass(frozen=True)
class _ReportFile:
    """What node-check.json holds that is not derived from the rows (ok, summary and blocking_hosts are)."""

    hosts: list[str]
    rows: list[Row]
    elapsed_s: float
    run_status: str


_REPORT_FILE = TypeAdapter(_ReportFile)


def grouped_values(values: dict[str, str], max_chars: int = 400) -> str:
    """`2.13.0 (node-a, node-b); absent (node-c)`, most common value first, cut at max_chars."""
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    parts = []
    for value, hosts in sorted(groups.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(hosts[:5]) + (f" and {len(hosts) - 5} more" if len(hosts) > 5 else "")
        parts.append(f"{value} ({shown})" if len(groups) > 1 or len(values) <= 5 else f"{value} (all {len(hosts)})")
    text = "; ".join(parts)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."
