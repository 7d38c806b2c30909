"""A distributed job refused at start-up is one acceptance finding with the job's own error; the rest is not
measured (CPU, gloo, 2 ranks, the local launcher)."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.report import plot_losses, table_rows, write_junit
from tasks.acceptance.checks import run_dimensions
from tasks.acceptance.suite import AcceptanceInputs, check_start, job_error, run_acceptance
from tasks.acceptance.workspace import RunOutcome
from tasks.acceptance.step import AcceptanceResult
from tasks.launch.base import JobHandle, JobState, JobStatus

pytestmark = pytest.mark.integration

WRONG_SHA = "0" * 64
DIMENSIONS = run_dimensions()


def test_a_dataset_made_with_another_tokenizer_is_one_start_finding_and_nothing_else_is_judged(
    make_spec, tmp_path: Path
) -> None:
    spec = make_spec({"data": {"tokenizer_sha256": WRONG_SHA}})
    acceptance = AcceptanceConfig.model_validate({"steps": 20, "save_every_steps": 10})
    inputs = AcceptanceInputs(cluster=spec.cluster, train=spec.training_config(), acceptance=acceptance)
    report = run_acceptance(inputs, tmp_path / "run")

    start, *rest = report.dimensions
    assert start.name == "start" and start.passed is False and start.status == "failed"
    assert "the distributed job never started training" in start.message
    # the trainer's DatasetError, as the job raised it
    assert f"made with tokenizer bytes sha256=None, the spec expects sha256={WRONG_SHA}" in start.message
    assert "prepare the dataset with the spec's tokenizer" in start.message
    assert [d.name for d in rest] == list(DIMENSIONS)
    assert all(d.passed is None and d.status == "not measured" for d in rest), [(d.name, d.passed) for d in rest]
    assert report.failed == ["start"] and report.not_measured == list(DIMENSIONS)
    assert not report.passed and report.drills == []
    # the reference, the correctness pair and the drills never ran
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["distributed"]

    data = json.loads(report.write(tmp_path).read_text())
    assert data["verdict"] == "failed"
    assert [d["status"] for d in data["dimensions"]] == ["failed"] + ["not measured"] * len(DIMENSIONS)
    suite = ET.parse(write_junit(report, tmp_path / "junit.xml")).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("7", "1", "6")
    assert [row["verdict"] for row in table_rows(report)] == ["FAIL"] + ["not measured"] * len(DIMENSIONS)
    assert plot_losses(report, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    summary = AcceptanceResult(verdict_text=data["verdict"], files={}, report=data, root=str(tmp_path)).summary()
    assert summary.startswith("failed: start FAIL, connectivity not measured")


def test_without_a_torchrun_report_the_error_is_the_last_error_line_of_the_job_log(tmp_path: Path) -> None:
    """Schedulers whose status carries no failure report (Slurm, Kubernetes): the job's log tells."""
    log = tmp_path / "train.log"
    log.write_text(
        "rank0 INFO training.train: starting\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 1, in <module>\n'
        "training.dataset.DatasetError: /data: made with tokenizer bpe sha256=ab, the spec expects sha256=cd; fix\n"
        "srun: error: node1: task 0: Exited with exit code 1\n"
    )
    handle = JobHandle("slurm", "42", "accept-distributed", str(tmp_path), str(log))
    outcome = RunOutcome(handle, JobStatus(JobState.FAILED, "FAILED", "NonZeroExitCode"), tmp_path)
    assert job_error(outcome).startswith("training.dataset.DatasetError: /data: made with tokenizer bpe sha256=ab")
    start = check_start(outcome)
    assert start is not None and "DatasetError: /data" in start.message and start.evidence["job"] == "slurm:42"
