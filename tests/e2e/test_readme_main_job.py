"""The README's main job: `tdeploy train examples/local.yaml` trains, checkpoints, and resumes."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.processes import run_group

pytestmark = pytest.mark.e2e


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_the_second() -> None:
    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", quick_start, flags=re.S)
    lines = [line for block in commands for line in block.strip().splitlines() if line.strip()]
    assert len(lines) == 2, lines
    assert "tdeploy run examples/local.yaml" in lines[0]
    assert lines[1] in (REPO / ".ci" / "run").read_text()


@pytest.mark.timeout(1500)  # two runs of up to 600 s each, plus headroom on a loaded machine
def test_tdeploy_train_on_the_embedded_default_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))
    assert tdeploy, "the console script is installed with the project"
    spec = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    spec["run"]["steps"] = 60  # the default's 200 steps, shortened for CI
    spec_path = tmp_path / "local.yaml"
    spec_path.write_text(yaml.safe_dump(spec))

    first = run_group([tdeploy, "train", str(spec_path)], timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "trained to step 60 (resumed from None)" in first.stdout
    out = tmp_path / "runs" / "local" / "output"
    result = json.loads((out / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    assert (tmp_path / "runs" / "local" / "checkpoints" / "step-00000060" / "COMMIT.json").exists()

    spec["run"]["steps"] = 80
    spec_path.write_text(yaml.safe_dump(spec))
    second = run_group([tdeploy, "train", str(spec_path)], timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "trained to step 80 (resumed from 60)" in second.stdout


def test_tdeploy_train_refuses_a_bad_spec_before_anything_runs(tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    spec["parallel"]["micro_batch"] = 0
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))
    proc = run_group([tdeploy, "train", str(spec_path)], timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "parallel.micro_batch=0: must be >= 1" in proc.stderr
    assert not (tmp_path / "runs").exists()
