"""`tdeploy plan` / `tdeploy check-nodes` and the flow's capacity and node steps write the same reports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import TINY_SPEC, deep_merge

pytestmark = pytest.mark.integration


def _reports(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*.json")}


def test_the_cli_step_commands_and_the_flow_steps_write_their_reports_in_the_same_place(
    prefect_harness, tiny_dataset: str, tmp_path: Path
) -> None:
    from prefect import flow

    from flows.deploy import plan_step
    from tasks.capacity.step import CapacityInputs
    from tasks.image.step import ImageInputs
    from tasks.nodes.step import NodesInputs
    from tasks.nodes.task import check_nodes
    from tasks.spec import load_spec

    folder = tmp_path / "deployment"
    data = deep_merge(TINY_SPEC, {"deployment_dir": str(folder), "data": {"dataset_url": tiny_dataset}})
    data["image"] = None
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    spec = load_spec(str(spec_file))

    runner = CliRunner()
    for command in ("plan", "check-nodes", "build-image"):
        out = runner.invoke(app, [command, str(spec_file)])
        assert out.exit_code == 0, out.output
    by_cli = _reports(folder)
    assert {"plan.json", "node-check.json"} <= by_cli, by_cli
    shutil.rmtree(folder)

    @flow
    def steps() -> None:
        plan_step(CapacityInputs.of(spec))
        check_nodes(NodesInputs.of(spec))

    steps()
    assert _reports(folder) == by_cli
    assert ImageInputs.of(spec).record_dir == str(folder / "image")
