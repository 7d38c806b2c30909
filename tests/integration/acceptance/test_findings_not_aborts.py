"""What goes wrong in a run is a finding in the report, never the end of it; and preemption is drilled.

CPU with gloo, 2 ranks, the tiny model, the local launcher. A NaN loss fails the stability and regression
dimensions (its figures are not finite) and acceptance.json and junit.xml are still written; a drill that an
error stops is that drill's failure; the preemption drill passes the trainer's own SIGTERM handling (checkpoint
at the step boundary, state preempted, 0 steps lost) and fails a handler that exits without the checkpoint,
with the steps that were lost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tasks.acceptance import drills
from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.drill_table import run_drills
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.mode import Mode
from tasks.acceptance.record import AcceptanceReport
from tasks.acceptance.report import write_junit
from tasks.acceptance.suite import AcceptanceInputs, run_acceptance
from tests.conftest import REPO
from tests.faults.job import injected

pytestmark = pytest.mark.integration

LOOSE = {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0, "correctness_max_rel_deviation": 1e-4}
SHORT = AcceptanceConfig.model_validate({"thresholds": LOOSE, "steps": 10, "save_every_steps": 3})

# Loaded by every Python process of the jobs (PYTHONPATH): the trainer's SIGTERM handler replaced by one that
# exits at once, without the step-boundary checkpoint.
HANDLER_EXITS_AT_ONCE = """\
import os
import sys

from training import preemption


def _exit_at_once(self, signum, frame):
    os.write(2, b"test hook: SIGTERM handler exits without the checkpoint\\n")
    sys.exit(128 + signum)


preemption.PreemptionWatch._handle = _exit_at_once
"""


def test_a_nan_loss_fails_its_dimensions_and_the_report_is_still_written(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"run": {"stop_on_nonfinite_loss": False}})  # a diverged run that trains on to its end
    faults = injected(nan_at_step=5)
    # canary: without the rank_kill drill, which a diverged run does not need to show the report survives
    inputs = AcceptanceInputs(
        cluster=spec.cluster, train=spec.training_config(), acceptance=SHORT, mode=Mode.CANARY, environment=faults
    )
    report = run_acceptance(inputs, tmp_path / "run")

    dims = {d.name: d for d in report.dimensions}
    assert dims["stability"].passed is False and "loss is nan at step 5" in dims["stability"].message
    regression = dims["regression"]
    assert regression.passed is False and "val_loss=nan" in regression.message, regression.message
    assert "the stability dimension" in regression.look_first
    assert not report.passed and report.ledger_entry is None
    written = report.write(tmp_path)
    assert json.loads(written.read_text())["verdict"] == "failed"
    assert AcceptanceReport.read(written).to_json()["dimensions"] == json.loads(written.read_text())["dimensions"]
    suite = ET.parse(write_junit(report, tmp_path / "junit.xml")).getroot()
    failed = {c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None}
    assert {"stability", "regression"} <= failed


def test_a_drill_stopped_by_an_error_is_that_drills_failure_and_the_next_drill_still_runs(
    make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: DrillContext) -> drills.DrillResult:
        raise drills.BrokenCommit("step-00000003/COMMIT.json lists no files: written by this drill's own job", "x")

    monkeypatch.setattr(drills, "drill_corrupt_checkpoint", broken)
    monkeypatch.setattr(drills, "drill_reshard", lambda ctx: drills.DrillResult("reshard", True))
    spec = make_spec()
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT)
    corrupt, reshard = run_drills(ctx, ["corrupt_checkpoint", "reshard"])
    assert corrupt.name == "corrupt_checkpoint" and corrupt.passed is False
    assert "the drill stopped: BrokenCommit: step-00000003/COMMIT.json lists no files" in corrupt.message
    assert reshard.passed is True


def test_the_preemption_drill_passes_a_job_that_checkpoints_at_the_step_boundary(make_spec, tmp_path: Path) -> None:
    spec = make_spec()
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT, DrillConfig(only=["preemption"]))
    (result,) = run_drills(ctx)
    evidence = result.evidence
    assert result.name == "preemption" and result.passed is True, result.message
    assert result.steps_lost == 0 and result.state_matched is True
    assert evidence["state"] == "preempted" and evidence["exit_code"] == 75
    assert evidence["preemption"]["step"] == evidence["stopped_at_step"] == evidence["resumed_from_step"]
    assert evidence["stopped_at_step"] > evidence["held_at_step"] - 1 >= SHORT.save_every_steps


def test_a_sigterm_handler_that_exits_without_the_checkpoint_fails_the_preemption_drill_with_the_steps_lost(
    make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANDLER_EXITS_AT_ONCE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), str(REPO), os.environ.get("PYTHONPATH"))
                                                     if p))  # fmt: skip
    spec = make_spec()
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, SHORT, DrillConfig(only=["preemption"]))
    (result,) = run_drills(ctx)
    evidence = result.evidence
    print(f"preemption drill against a handler that exits: steps lost {result.steps_lost} (passing: 0), "
          f"state {evidence.get('state')}")  # fmt: skip
    assert result.passed is False, evidence
    assert result.steps_lost is not None and result.steps_lost > 0
    assert evidence["state"] == "failed" and evidence["preemption"] is None
    assert "not preempted" in result.message and "left no preemption record" in result.message
    assert f"{result.steps_lost} step(s) lost" in result.message
    # the resubmission still recovered from the last checkpoint before the stop, bit for bit
    assert result.state_matched is True and evidence["resumed_from_step"] == SHORT.save_every_steps
