"""The README's main job: `tdeploy run examples/local.yaml` runs every step of deploy-training and passes,
and a second run in the same folder passes too: its training resumes, its acceptance starts afresh."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.processes import run_group

pytestmark = pytest.mark.e2e

DRILLS = {"rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage"}


def _tdeploy_run(tmp_path: Path, env: dict[str, str]) -> None:
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))
    proc = run_group([tdeploy, "run", str(REPO / "examples" / "local.yaml")], timeout=2400, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "deploy-training local: succeeded" in proc.stdout
    # the end of the run names the one folder every report is in, and how to open the run in Prefect's UI
    assert f"reports: {(tmp_path / 'runs' / 'local').resolve()} (summary.json, summary.md)" in proc.stdout
    assert "/runs/flow-run/" in proc.stdout
    summary = json.loads((tmp_path / "runs" / "local" / "summary.json").read_text())
    assert summary["failed_step"] is None, summary


def _latest_acceptance(runs: Path) -> Path:
    root = Path(json.loads((runs / "acceptance" / "latest.json").read_text())["root"])
    acceptance = json.loads((root / "acceptance.json").read_text())
    assert acceptance["verdict"] == "passed" and len(acceptance["dimensions"]) == 6, acceptance
    drills = json.loads((root / "drills" / "acceptance.json").read_text())
    assert {d["name"] for d in drills["drills"]} == DRILLS
    assert all(d["passed"] for d in drills["drills"]), drills
    return root


@pytest.mark.timeout(5400)  # two whole runs, each ~6 min alone and far longer on two shared cores
def test_the_main_job_passes_twice_in_a_row_resuming_training_and_accepting_afresh(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "TDEPLOY_HOME": str(tmp_path / "tdeploy-home"),
    }
    env.pop("PREFECT_API_URL", None)
    runs = tmp_path / "runs" / "local"

    _tdeploy_run(tmp_path, env)
    assert json.loads((runs / "plan.json").read_text())["fits"]
    assert json.loads((runs / "node-check.json").read_text())["ok"]
    first_result = json.loads((runs / "output" / "result.json").read_text())
    assert first_result["steps"] == 200 and first_result["resumed_from_step"] is None
    first = _latest_acceptance(runs)

    _tdeploy_run(tmp_path, env)
    second_result = json.loads((runs / "output" / "result.json").read_text())
    assert second_result["steps"] == 200 and second_result["resumed_from_step"] == 200, second_result
    second = _latest_acceptance(runs)
    assert second != first and second.parent == first.parent == runs / "acceptance"
    assert first.is_dir(), "the first run's workspace is kept (acceptance.keep_runs=3)"
