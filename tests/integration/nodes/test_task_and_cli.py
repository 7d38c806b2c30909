"""The Prefect task `check_nodes` on a real (temporary) Prefect server, the CLI on the embedded default, the lint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import flow
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from typer.testing import CliRunner

from flows.cli import app
from tasks.launch.cluster import ClusterConfig
from tasks.nodes.config import NodesConfig
from tasks.nodes.report import NodeReport
from tasks.nodes.step import NodesInputs, NodesResult
from tasks.nodes.task import check_nodes
from tests.conftest import REPO
from tests.integration.nodes.conftest import free_port

pytestmark = pytest.mark.integration

LOCAL = ClusterConfig(scheduler="local", procs_per_node=2)


def run_task(nodes: NodesConfig, cluster: ClusterConfig, report: Path) -> tuple[str, int, Any]:
    """Run `check_nodes` (one retry, no delay) in a flow; returns (final state type, run count, result or error)."""

    @flow
    def nodes_flow() -> dict[str, Any]:
        state = check_nodes.with_options(retries=1, retry_delay_seconds=0)(
            NodesInputs(nodes=nodes, cluster=cluster, report_path=str(report)), return_state=True
        )
        data = state.result(raise_on_failure=False)
        return {
            "state": state.type.value,
            "id": str(state.state_details.task_run_id),
            "data": data.model_dump() if isinstance(data, NodesResult) else str(data),
        }

    out = nodes_flow()
    with get_client(sync_client=True) as client:
        run_count = client.read_task_run(UUID(out["id"])).run_count
    return out["state"], run_count, out["data"]


@pytest.mark.usefixtures("prefect_harness")
def test_task_publishes_the_table_and_never_retries_a_refused_node_or_a_finding(tmp_path: Path) -> None:
    state, runs, data = run_task(NodesConfig(), LOCAL, tmp_path / "ok.json")
    assert (state, runs) == ("COMPLETED", 1), data
    assert data["ok"] is True and data["hosts"] == ["localhost"]
    assert json.loads((tmp_path / "ok.json").read_text())["ok"] is True
    artifact = Artifact.get("node-checks")
    assert artifact is not None
    rows = {row["check"]: row for row in json.loads(artifact.data)}
    assert rows["torch"]["severity"] == "ok" and rows["NVIDIA driver"]["values"] == "absent (localhost)"

    ghost = NodesConfig(hosts=[{"name": "ghost", "address": "127.0.0.1", "port": free_port()}], connect_timeout_s=5)
    state, runs, error = run_task(ghost, LOCAL, tmp_path / "ghost.json")
    assert (state, runs) == ("FAILED", 1), "a node that refuses connections needs its sshd started: never retried"
    assert "unreachable: ghost" in error

    missing = NodesConfig(storage=[{"path": str(tmp_path / "no-such-mount")}])
    state, runs, error = run_task(missing, LOCAL, tmp_path / "missing.json")
    assert (state, runs) == ("FAILED", 1), "a missing mount does not fix itself: never retried"
    assert f"{tmp_path / 'no-such-mount'} is not usable on localhost: does not exist" in error


def test_cli_checks_the_embedded_default_spec_on_localhost(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["check-nodes", str(REPO / "examples" / "local.yaml"), "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "1 node(s) ready: 0 blocking" in out.output
    report = NodeReport.read(tmp_path / "node-check.json")
    assert report.ok is True and report.hosts == ["localhost"]


def test_ansible_lint_passes_on_the_playbooks() -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        [str(bin_dir / "ansible-lint"), "--offline", "--profile", "production", "playbooks/"],
        stdin=subprocess.DEVNULL,  # ansible refuses a non-blocking stdin inherited from the caller
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr
