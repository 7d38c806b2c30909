"""The end of `tdeploy run`: the steps' table, the reports folder, the UI and a failed run's diagnosis."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from flows.runner import FIGURES_CHARS, print_summary
from tasks.image.step import ImageStepResult
from tasks.nodes.step import NodesResult
from tasks.pipeline import RunSummary, summarize

LONG_REASON = "no image builder on this machine (buildah, podman and docker are missing); " * 4
NODES = NodesResult(ok=True, hosts=["localhost"], warnings=0, report_path="runs/x/node-check.json", elapsed_s=1.0)
SKIPPED = ImageStepResult(status="skipped", reason=LONG_REASON)


def _printed(summary: RunSummary, reports_dir: str = "runs/x", flow_run_id: str | None = "1234-abcd") -> str:
    out = Console(record=True, width=200, color_system=None)
    print_summary(summary, reports_dir, flow_run_id, ephemeral=True, out=out)
    return out.export_text()


def _row(text: str, title: str) -> str:
    return next(line for line in text.splitlines() if title in line)


def test_a_skipped_image_step_shows_skipped_and_its_long_reason_is_cut_in_the_table() -> None:
    summary = summarize("x", {"nodes": NODES, "image": SKIPPED}, None, None, None)
    text = _printed(summary)
    row = _row(text, "image build")
    assert "skipped" in row and "passed" not in row
    assert "…" in row and LONG_REASON.strip() not in text
    assert len(summary.steps[3].note) > FIGURES_CHARS  # summary.json keeps the whole reason
    assert "passed" in _row(text, "node environment checks")


def test_the_end_of_a_run_names_the_reports_folder_and_the_flow_run_in_the_ui(tmp_path: Path) -> None:
    text = _printed(summarize("x", {"nodes": NODES}, None, None, None), str(tmp_path / "runs" / "x"))
    assert f"reports: {tmp_path / 'runs' / 'x'}" in text
    assert "runs/flow-run/1234-abcd" in text and "prefect server start" in text and "PREFECT_HOME=" in text


def test_a_failed_run_prints_the_diagnosis_findings_with_evidence_and_fix() -> None:
    diagnosis = {
        "findings": [
            {"cause": "rendezvous timeout", "evidence": ["train.log: RendezvousTimeoutError"], "fix": "open port 29500"}
        ]
    }
    summary = summarize("x", {"nodes": NODES}, "job", "JobFailed: training failed (exit 1)", diagnosis)
    text = _printed(summary)
    assert "FAILED" in _row(text, "job submission") and "not run" in _row(text, "acceptance tests")
    assert "1. rendezvous timeout: open port 29500" in text
    assert "evidence: train.log: RendezvousTimeoutError" in text


def test_the_summary_written_to_the_reports_folder_reads_back_whole(tmp_path: Path) -> None:
    summary = summarize("x", {"image": SKIPPED}, "data", "boom", None)
    summary.write(tmp_path)
    assert RunSummary.read(tmp_path) == summary and (tmp_path / "summary.md").read_text() == summary.markdown()
