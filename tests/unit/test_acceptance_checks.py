"""The check table drives the acceptance report: which dimensions a mode judges, in which order, what a failed
start leaves not measured, and the docs site's dimension table; a row added to it needs no other edit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.acceptance import checks, suite
from tasks.acceptance.checks import Check, Judged, Severity, Stage
from tasks.acceptance.mode import Mode
from tasks.acceptance.record import AcceptanceReport
from tasks.acceptance.workspace import RunOutcome
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.spec import DeploymentSpec
from tests.conftest import REPO
from validation.acceptance import DimensionResult


def _tokenizer(judged: Judged) -> DimensionResult:
    """A new dimension: what it judges is the test's business, that the table runs it is the point."""
    return DimensionResult(
        name="tokenizer", passed=False, measured={"world": judged.cluster.world_size}, message="tokenizer drifted"
    )


NEW_ROW = Check(
    name="tokenizer", judges="the tokenizer the run used", severity=Severity.FAILS, stage=Stage.RUNS,
    docs="tests/unit/test_acceptance_checks.py", judge=_tokenizer,
)  # fmt: skip


@pytest.fixture
def with_new_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table with NEW_ROW after data_consistency (nothing else changed)."""
    at = [c.name for c in checks.CHECKS].index("data_consistency") + 1
    monkeypatch.setattr(checks, "CHECKS", (*checks.CHECKS[:at], NEW_ROW, *checks.CHECKS[at:]))


def _finished_without_artifacts(folder: Path, name: str) -> RunOutcome:
    """A job that ended having written nothing: every dimension finds that, none raises."""
    folder.mkdir(parents=True)
    handle = JobHandle("local", "1", name, str(folder), str(folder / "train.log"))
    return RunOutcome(handle, JobStatus(JobState.FAILED, "failed", "exit 1"), folder)


def test_a_row_added_to_the_table_is_judged_and_listed_in_report_order_without_other_edits(
    with_new_row: None, make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    spec = make_spec()
    dist = _finished_without_artifacts(tmp_path / "distributed", "accept-distributed")
    reference = _finished_without_artifacts(tmp_path / "reference", "accept-reference")

    judged = suite.judge(spec.cluster, spec.training_config(), spec.acceptance, dist, reference)
    names = ["connectivity", "correctness", "performance", "stability", "data_consistency", "tokenizer"]
    assert [d.name for d in judged] == names
    new = judged[-1]
    assert (new.passed, new.message, new.measured) == (False, "tokenizer drifted", {"world": 2})

    assert checks.dimension_names(Mode.FULL) == ["start", *names, "recovery", "regression"]
    assert checks.dimension_names(Mode.CANARY) == ["start", *names, "regression"]
    start = DimensionResult(name="start", passed=False, message="the distributed job never started training")
    report = AcceptanceReport(dimensions=checks.not_started(start))
    assert report.not_measured == [*names, "recovery"] and report.failed == ["start"]
    recovery = DimensionResult(name="recovery", passed=True)
    regression = DimensionResult(name="regression", passed=True)
    ordered = checks.in_report_order([regression, recovery, *reversed(judged)])
    assert [d.name for d in ordered] == [*names, "recovery", "regression"]
    assert "| tokenizer | the tokenizer the run used | fails the run |" in checks.markdown_table()


def test_a_report_holds_the_tables_rows_and_a_canary_no_recovery() -> None:
    assert checks.dimension_names(Mode.FULL) == checks.dimension_names(Mode.SOAK) == [c.name for c in checks.CHECKS]
    assert len(checks.CHECKS) == 8
    assert "recovery" not in checks.dimension_names(Mode.CANARY)
    assert checks.run_dimensions() == [
        "connectivity", "correctness", "performance", "stability", "data_consistency", "recovery"
    ]  # fmt: skip
    assert all((c.judge is not None) == (c.stage is Stage.RUNS) for c in checks.CHECKS)


def test_the_docs_dimension_table_is_the_check_tables() -> None:
    page = REPO / "docs" / "pages" / "concepts" / "acceptance.md"
    assert checks.markdown_table() in page.read_text(), f"paste checks.markdown_table() into {page}"
