"""Validating a spec and planning it work offline, on the example specs as they are (their paths name a cluster's
shared storage and object store); the path and storage checks run with --check-paths or in the commands that use
the paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.common import PATHS_NOT_CHECKED
from tasks.capacity.record import read_plan
from tests.conftest import REPO

CLUSTER_EXAMPLES = ("plan-70b", "slurm", "multihost", "kubernetes")


@pytest.mark.parametrize("name", CLUSTER_EXAMPLES)
def test_a_cluster_example_validates_and_plans_on_a_machine_without_its_storage(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths (runs/<name>) land in tmp_path
    spec = str(REPO / "examples" / f"{name}.yaml")
    validated = CliRunner().invoke(app, ["validate-spec", spec])
    assert validated.exit_code == 0, validated.output
    assert validated.output.startswith("ok") and PATHS_NOT_CHECKED in validated.output
    planned = CliRunner().invoke(app, ["plan", spec, "--out", str(tmp_path / "plan")], terminal_width=200)
    assert planned.exit_code == 0, planned.output
    assert read_plan(str(tmp_path / "plan" / "plan.json")).fits is True
    assert "--check-paths" in planned.output


def test_check_paths_still_reports_a_missing_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load((REPO / "examples" / "slurm.yaml").read_text())
    data["data"]["dataset_url"] = str(tmp_path / "no-such-dataset")
    data["run"]["output_url"] = data["checkpoint"]["url"] = data["deployment_dir"] = str(tmp_path / "out")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    for command in (["validate-spec", str(spec)], ["plan", str(spec), "--out", str(tmp_path / "plan")]):
        result = CliRunner().invoke(app, [*command, "--check-paths"])
        assert result.exit_code == 2, result.output
        assert f"data.dataset_url={tmp_path / 'no-such-dataset'}: does not exist" in result.output
    assert not (tmp_path / "plan").exists()  # refused before the plan


def test_a_plan_whose_default_folder_cannot_be_written_here_is_printed_and_says_why_plan_json_was_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    data = yaml.safe_load((REPO / "examples" / "plan-70b.yaml").read_text())
    data["deployment_dir"] = str(blocker / "llama-70b-plan")  # capacity.output_url: under a file
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    planned = CliRunner().invoke(app, ["plan", str(spec)], terminal_width=200)
    assert planned.exit_code == 0, planned.output
    assert "llama-70b-plan: 70,553,706,496 parameters" in planned.output  # the plan itself is printed
    assert f"plan.json not written: capacity.output_url={blocker / 'llama-70b-plan'}: cannot be created" in (
        planned.output
    )
    assert "pass --out DIR" in planned.output
