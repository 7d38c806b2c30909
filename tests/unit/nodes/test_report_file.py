"""node-check.json is owned by NodeReport: what `write` wrote, `read` gives back, and the diagnosis reads it so."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.diagnose import diagnose_run, node_report_if_written
from tasks.nodes.check import build_report
from tasks.nodes.report import NodeReport, Row, UnreadableNodeReport

ABC = ["node-a", "node-b", "node-c"]


def _blocked_port() -> NodeReport:
    rows = [
        Row("torch", dict.fromkeys(ABC, "2.5.1")),
        Row(
            "rendezvous port 29500",
            {"node-a": "open", "node-b": "closed", "node-c": "open"},
            severity="blocking",
            finding="port 29500 is closed on node-b",
            remediation="open port 29500 between the nodes",
            hosts=["node-b"],
            transient=True,
        ),
        Row("kernel", dict.fromkeys(ABC, "6.1"), severity="warning", finding="old", remediation="upgrade"),
    ]
    return NodeReport(hosts=ABC, rows=rows, elapsed_s=1.25, run_status="successful", log="PLAY RECAP\n")


def test_a_written_report_reads_back_with_its_rows_verdict_and_log(tmp_path: Path) -> None:
    report = _blocked_port()
    path = report.write(tmp_path / "reports" / "node-check.json")

    back = NodeReport.read(path)

    assert back == report
    assert not back.ok and back.blocking_hosts == ["node-b"] and [r.check for r in back.warnings] == ["kernel"]
    assert back.row("rendezvous port 29500").transient is True
    assert back.summary() == report.summary()


def test_a_report_built_from_a_playbook_run_round_trips(
    tmp_path: Path, make_run: Callable, make_plan: Callable
) -> None:
    odd = {"facts": {"python": {"torch": {"version": "2.4.0"}}}}
    report = build_report(make_run({"node-a": None, "node-b": odd, "node-c": None}), make_plan(ABC))

    back = NodeReport.read(report.write(tmp_path / "node-check.json"))

    assert back.rows == report.rows and back.hosts == report.hosts and back.ok == report.ok


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "Invalid JSON"),
        ('{"hosts": ["a"], "rows": [], "elapsed_s": 1.0}', "run_status: Field required"),
        (
            '{"hosts": ["a"], "elapsed_s": 1, "run_status": "ok", "rows": [{"check": "x", "values": {}, '
            '"severity": "fatal"}]}',
            "rows.0.severity: Input should be 'ok', 'warning' or 'blocking'",
        ),
    ],
)
def test_a_file_that_is_not_a_node_report_is_refused_naming_it_and_the_field(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = tmp_path / "node-check.json"
    path.write_text(content)
    with pytest.raises(UnreadableNodeReport) as caught:
        NodeReport.read(path)
    assert str(caught.value).startswith(f"{path}: ") and problem in str(caught.value)
    assert "tdeploy check-nodes" in str(caught.value)


def test_the_diagnosis_reads_the_node_report_file_and_names_its_blocking_port(tmp_path: Path) -> None:
    path = _blocked_port().write(tmp_path / "node-check.json")
    run = tmp_path / "output"
    run.mkdir()

    assert node_report_if_written(str(tmp_path / "absent.json")) is None
    diagnosis = diagnose_run(run, "training failed", None, str(path))

    assert "node_report" in diagnosis.inputs
    [finding] = [f for f in diagnosis.findings if f.cause.startswith("rendezvous")]
    assert "node check rendezvous port 29500: port 29500 is closed on node-b open port 29500 between the nodes" in (
        finding.evidence
    )
    assert json.loads(path.read_text())["ok"] is False  # the file keeps its format: ok, summary, rows
