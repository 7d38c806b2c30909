"""A node whose SSH port refuses connections fails the check at once: real Ansible over SSH, a real Prefect task."""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from tasks.launch.cluster import ClusterConfig
from tasks.nodes.config import NodesConfig
from tasks.nodes.step import NodesInputs
from tasks.nodes.task import check_nodes
from tests.integration.nodes.conftest import free_port

pytestmark = pytest.mark.integration


@pytest.mark.usefixtures("prefect_harness")
def test_a_refused_connection_is_not_retried_and_names_the_host_and_the_fix(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there: ssh gets "Connection refused"
    ghost = NodesConfig(hosts=[{"name": "ghost", "address": "127.0.0.1", "port": port}], connect_timeout_s=5)

    @flow
    def nodes_flow() -> dict[str, str]:
        state = check_nodes.with_options(retries=2, retry_delay_seconds=0)(
            NodesInputs(
                nodes=ghost,
                cluster=ClusterConfig(scheduler="local", procs_per_node=1),
                report_path=str(tmp_path / "ghost.json"),
            ),
            return_state=True,
        )
        return {
            "state": state.type.value,
            "id": str(state.state_details.task_run_id),
            "error": str(state.result(raise_on_failure=False)),
        }

    out = nodes_flow()
    with get_client(sync_client=True) as client:
        run_count = client.read_task_run(UUID(out["id"])).run_count
    assert (out["state"], run_count) == ("FAILED", 1), out["error"]
    assert "node checks failed on ghost" in out["error"]
    assert "Connection refused" in (tmp_path / "ghost.json").read_text()
    assert "start sshd on ghost (or fix their port in nodes.hosts)" in out["error"]
    assert "retrying" not in out["error"]
