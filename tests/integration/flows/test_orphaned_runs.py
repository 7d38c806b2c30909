"""Flow runs left Running by a killed `tdeploy run` are marked Crashed, on a real (temporary) Prefect server."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import TINY_SPEC, deep_merge
from training import process

pytestmark = pytest.mark.integration


def _dead_supervisor():  # noqa: ANN202 - Supervisor
    """A Supervisor of this host whose process ran and exited."""
    from tasks.launch.orphans import Supervisor

    proc = subprocess.Popen(["sleep", "30"])
    started = process.start_time(proc.pid)
    proc.kill()
    proc.wait()
    here = Supervisor.current()
    return Supervisor(here.host, proc.pid, started or "?", here.boot_id)


def _state(client, flow_run_id) -> str:  # noqa: ANN001
    return client.read_flow_run(flow_run_id).state.type.value


def test_a_running_flow_run_whose_supervisor_is_gone_is_marked_crashed_with_its_task_runs(prefect_harness) -> None:
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from tasks.launch.orphans import Supervisor, crash_orphaned_flow_runs

    @flow(name="deploy-training-orphans")
    def deploy() -> None: ...

    @task(name="submit_job")
    def submit() -> None: ...

    dead = _dead_supervisor()
    with get_client(sync_client=True) as client:
        orphan = client.create_flow_run(deploy, tags=[dead.tag()], state=Running())
        task_run = client.create_task_run(submit, orphan.id, dynamic_key="0", state=Running())
        supervised = client.create_flow_run(deploy, tags=[Supervisor.current().tag()], state=Running())
        untagged = client.create_flow_run(deploy, state=Running())

        crashed = {c.flow_run_id: c for c in crash_orphaned_flow_runs(client)}

        assert orphan.id in crashed and supervised.id not in crashed and untagged.id not in crashed
        assert crashed[orphan.id].task_runs == [task_run.name]
        assert f"its supervisor pid {dead.pid} on host {dead.host} is gone" in crashed[orphan.id].describe()
        assert _state(client, orphan.id) == "CRASHED"
        assert f"pid {dead.pid}" in client.read_flow_run(orphan.id).state.message
        assert client.read_task_run(task_run.id).state.type.value == "CRASHED"
        assert _state(client, supervised.id) == "RUNNING" and _state(client, untagged.id) == "RUNNING"
        assert crash_orphaned_flow_runs(client) == []  # done once


def test_tdeploy_run_crashes_runs_of_a_killed_run_and_tags_its_own_with_its_supervisor(
    prefect_harness, tiny_dataset: str, tmp_path: Path, monkeypatch
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    import flows.deploy
    from flows.cli import app
    from tasks.launch.orphans import Supervisor

    seen: dict[str, object] = {}

    @flow(name="deploy-training")
    def stand_in(spec) -> None:  # noqa: ANN001 - the real flow's steps are tested elsewhere
        from prefect.runtime import flow_run

        seen["tags"], seen["id"] = list(flow_run.tags), flow_run.id

    monkeypatch.setattr(flows.deploy, "deploy_training", stand_in)
    dead = _dead_supervisor()
    with get_client(sync_client=True) as client:
        orphan = client.create_flow_run(stand_in, tags=[dead.tag()], state=Running())
    spec = deep_merge(
        TINY_SPEC,
        {"data": {"dataset_url": tiny_dataset}, "checkpoint": {"url": str(tmp_path / "ckpt")},
         "run": {"output_url": str(tmp_path / "out")}},
    )  # fmt: skip
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    result = CliRunner().invoke(app, ["run", str(tmp_path / "spec.yaml")])

    assert result.exit_code == 0, result.output
    assert f"flow run {orphan.name} ({orphan.id}) of deploy-training: marked Crashed" in result.output
    assert Supervisor.current().tag() in seen["tags"]
    with get_client(sync_client=True) as client:
        assert _state(client, orphan.id) == "CRASHED"
        assert _state(client, seen["id"]) == "COMPLETED"
