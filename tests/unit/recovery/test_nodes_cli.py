"""`tdeploy nodes quarantine|clear|list`: an operator's hand on the node memory the restart policy reads."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.common import EXIT_USER_ERROR
from tasks.paths import DeploymentPaths
from tasks.recovery.quarantine import NodeMemory
from tasks.spec import load_spec
from tests.conftest import TINY_SPEC, deep_merge


def _spec(tmp_path: Path) -> str:
    raw = deep_merge(TINY_SPEC, {"name": "nodes-cli", "deployment_dir": str(tmp_path / "deploy"),
                                 "data": {"dataset_url": "/d"}, "checkpoint": {"url": None},
                                 "run": {"output_url": None}, "recovery": {"quarantine_after_failures": 2}})  # fmt: skip
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _invoke(*args: str):  # noqa: ANN202 - click's Result
    return CliRunner().invoke(app, list(args), terminal_width=200)


def test_an_operator_quarantines_lists_and_clears_a_host_in_the_deployments_ledger(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert "no host failures recorded" in _invoke("nodes", "list", "--spec", spec).output
    done = _invoke("nodes", "quarantine", "node-3", "--spec", spec, "--reason", "ECC errors on GPU 2")
    assert done.exit_code == 0, done.output
    assert "node-3: quarantined since" in done.output and "ECC errors on GPU 2" in done.output
    memory_url = DeploymentPaths.of(load_spec(spec)).node_memory_url
    assert memory_url.startswith(str(tmp_path / "deploy")) and memory_url.endswith("/ledger/nodes")
    parsed = load_spec(spec)
    assert NodeMemory(memory_url, parsed.recovery).quarantined() == ["node-3"]  # what the launch step reads
    listed = _invoke("nodes", "list", "--spec", spec)
    assert listed.exit_code == 0 and "node-3: quarantined since" in listed.output
    cleared = _invoke("nodes", "clear", "node-3", "--spec", spec)
    assert cleared.exit_code == 0 and "node-3: in service" in cleared.output
    assert NodeMemory(memory_url, parsed.recovery).quarantined() == []


def test_a_host_that_is_not_a_host_name_is_refused_with_exit_2(tmp_path: Path) -> None:
    result = _invoke("nodes", "quarantine", "node-1;reboot", "--spec", _spec(tmp_path))
    assert result.exit_code == EXIT_USER_ERROR
    assert "is not a host name" in result.output
