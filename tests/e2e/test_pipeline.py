"""The README's main job: `tdeploy run examples/local.yaml` runs every step of deploy-training and passes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_deploy_training_passes_every_step_on_the_embedded_default(tmp_path: Path) -> None:
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "TDEPLOY_HOME": str(tmp_path / "tdeploy-home"),
    }
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [tdeploy, "run", str(REPO / "examples" / "local.yaml")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "deploy-training completed for local" in proc.stdout
    runs = tmp_path / "runs" / "local"
    assert json.loads((runs / "plan.json").read_text())["fits"]
    assert json.loads((runs / "node-check.json").read_text())["ok"]
    assert json.loads((runs / "output" / "result.json").read_text())["steps"] == 200
    acceptance = json.loads((runs / "acceptance" / "acceptance.json").read_text())
    assert acceptance["verdict"] == "passed" and len(acceptance["dimensions"]) == 6
    drills = json.loads((runs / "acceptance" / "drills" / "acceptance.json").read_text())
    assert {d["name"] for d in drills["drills"]} == {
        "rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage",
    }  # fmt: skip
    assert all(d["passed"] for d in drills["drills"])
