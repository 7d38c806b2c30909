"""`tdeploy diagnose` on an acceptance run that failed the regression gate: a known cause with its figures, the
baseline entry and the fix; Markdown rendered on a terminal, the Markdown text itself in a file or a pipe."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from flows.cli import accept, app
from tasks.acceptance.record import AcceptanceReport
from tasks.diagnose import diagnose
from validation.acceptance import DimensionResult

ENTRY = "20260102T030405.123456Z-1a2b3c"
DROP = f"tokens/s 730 is 27% below the baseline's 1000 (entry {ENTRY}; allowed 10%)"
CURVE = f"loss curve at the same seed: final loss 3.6000 is 20.0% above the baseline's 3.0000 (entry {ENTRY})"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """An acceptance run workspace whose report failed the regression dimension on two figures."""
    regression = DimensionResult(
        name="regression", passed=False,
        measured={"tokens_per_s": {"baseline": 1000.0, "run": 730.0, "verdict": "FAIL"}},
        threshold={"tokens_per_s": 0.1},
        evidence={"baseline_entry": ENTRY, "baseline_created_at": "2026-01-02T03:04:05+00:00"},
        message=f"{DROP}; {CURVE}", look_first=f"what changed since entry {ENTRY}: `tdeploy history` lists the entries",
    )  # fmt: skip
    passed = DimensionResult(name="connectivity", passed=True, measured={}, threshold={})
    AcceptanceReport(dimensions=[passed, regression]).write(tmp_path / "ws")
    return tmp_path / "ws"


def test_a_regression_is_a_known_cause_with_its_figures_and_the_baseline(workspace: Path) -> None:
    result = CliRunner().invoke(app, ["diagnose", str(workspace)])
    assert result.exit_code == 1, result.output
    assert "No known cause matched" not in result.output
    assert "**regression against the baseline**" in result.output  # not a terminal: the Markdown text
    assert DROP in result.output and CURVE in result.output and f"ledger entry {ENTRY}" in result.output
    assert "tdeploy baseline SPEC --run" in result.output


def test_the_flows_diagnosis_finds_the_report_its_acceptance_error_names(workspace: Path) -> None:
    error = f"acceptance failed: regression; see {AcceptanceReport.path_in(workspace)}"
    (finding,) = diagnose(error).findings
    assert finding.cause == "regression against the baseline" and finding.evidence[:2] == [DROP, CURVE]


def test_on_a_terminal_the_diagnosis_is_rendered_not_printed_as_markdown(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(accept, "console", Console(file=out, force_terminal=True, width=300, color_system=None))
    result = CliRunner().invoke(app, ["diagnose", str(workspace)])
    assert result.exit_code == 1
    shown = out.getvalue()
    assert "regression against the baseline" in shown and "Diagnosis" in shown
    assert "**" not in shown and "# Diagnosis" not in shown and "`" + DROP not in shown
