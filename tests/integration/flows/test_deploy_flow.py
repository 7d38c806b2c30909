"""The deploy-training flow's behaviour on a real (temporary) Prefect server: failures stop it with a
diagnosis made from real failures, user errors are not retried, finished pure steps are cached."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _task_runs(flow_run_id) -> list:  # noqa: ANN001
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    return asyncio.run(read())


def _artifact(key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    async def read() -> list:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
            )

    artifacts = asyncio.run(read())
    return str(artifacts[0].data) if artifacts else ""


def _run(spec) -> tuple:  # noqa: ANN001
    from flows.deploy import deploy_training

    state = deploy_training(spec, return_state=True)
    runs = {r.name.rsplit("-", 1)[0]: r for r in _task_runs(state.state_details.flow_run_id)}
    return state, runs


def _spec(make_spec, tmp_path: Path, overrides: dict, name: str):  # noqa: ANN001, ANN202
    base = {
        "deployment_dir": str(tmp_path / name),  # every report of the deployment, derived in the spec
        "image": None,
        "run": {"steps": 20},
        "acceptance": {
            "steps": 40,
            "save_every_steps": 10,
            "thresholds": {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0, "compute_share_min": 0.02},
        },
        "drills": {"only": []},
    }
    from tests.conftest import deep_merge

    return make_spec(deep_merge(base, overrides), name=name)


def test_an_impossible_batch_stops_at_capacity_without_retry_and_the_diagnosis_says_out_of_memory(
    prefect_harness, make_spec, tmp_path: Path
) -> None:
    spec = _spec(make_spec, tmp_path, {"parallel": {"micro_batch": 4096}, "model": {"seq_len": 4096}}, "oom")
    state, runs = _run(spec)
    assert state.is_failed()
    assert runs["estimate_capacity"].state.is_failed() and runs["estimate_capacity"].run_count == 1
    assert "check_nodes" not in runs  # nothing after the failed step ran
    diagnosis = _artifact("diagnosis")
    assert "out of memory" in diagnosis and "GiB per device" in diagnosis
    summary = _artifact("deployment-summary")
    assert "| capacity estimation | **FAILED** |" in summary and "| node environment checks | not run |" in summary


def test_a_blocked_rendezvous_port_fails_and_the_diagnosis_points_at_the_port(
    prefect_harness, make_spec, tmp_path: Path
) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        spec = _spec(make_spec, tmp_path, {"cluster": {"rdzv_port": port}}, "blocked")
        state, runs = _run(spec)
    finally:
        holder.close()
    assert state.is_failed()
    diagnosis = _artifact("diagnosis")
    assert "rendezvous / communication timeout at start" in diagnosis and "port" in diagnosis


def test_an_unwritable_checkpoint_folder_is_refused_by_the_preflight_before_any_step_runs(
    prefect_harness, make_spec, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    spec = _spec(make_spec, tmp_path, {"checkpoint": {"url": str(blocker / "checkpoints"), "save_retries": 0}}, "ckpt")
    state, runs = _run(spec)
    assert state.is_failed() and runs["load_spec"].state.is_failed() and runs["load_spec"].run_count == 1
    assert not {"estimate_capacity", "check_nodes", "submit_job"} & set(runs), sorted(runs)
    assert f"checkpoint.url={blocker / 'checkpoints'}" in _artifact("deployment-summary")
    assert not (tmp_path / "ckpt" / "output").exists()


def test_a_tampered_dataset_stops_the_flow_at_the_data_step_and_a_rerun_reuses_the_finished_pure_steps(
    prefect_harness, make_spec, tiny_dataset: str, tmp_path: Path
) -> None:
    # A dataset whose shard was tampered with after it was prepared (same size, other bytes): the preflight
    # finds it in place, the data step's token suite refuses it (a user error: not retried), and no job starts.
    tampered = tmp_path / "tampered-dataset"
    shutil.copytree(tiny_dataset, tampered)
    shard = sorted((tampered / "train").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[:16] = bytes(16)
    shard.write_bytes(bytes(data))
    spec = _spec(make_spec, tmp_path, {"data": {"dataset_url": str(tampered)}}, "tampered")
    state, runs = _run(spec)
    assert state.is_failed() and runs["check_dataset"].state.is_failed() and runs["check_dataset"].run_count == 1
    assert "submit_job" not in runs and not (tmp_path / "tampered" / "output").exists()
    summary = _artifact("deployment-summary")
    assert "| data preprocessing and validation | **FAILED** |" in summary
    assert f"{shard.relative_to(tampered)} has sha256 " in summary

    again, reruns = _run(spec)
    assert again.is_failed()
    for pure in ("estimate_capacity", "build_image"):
        assert reruns[pure].state.name == "Cached", (pure, reruns[pure].state)


_ONE_ATTEMPT = {"max_attempts": 1}


def _when_task(proxy_action, task_name: str, reached, timeout_s: float = 300.0) -> None:  # noqa: ANN001
    """Call `proxy_action` once a run of `task_name` is in a state that `reached(state_name)` accepts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    since = datetime.now(UTC)  # the harness's database also holds earlier tests' task runs

    async def wait() -> None:
        async with get_client() as client:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while asyncio.get_running_loop().time() < deadline:
                runs = await client.read_task_runs(
                    task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=task_name))
                )
                if any(r.created >= since and r.state is not None and reached(r.state.name) for r in runs):
                    return
                await asyncio.sleep(0.2)

    try:
        asyncio.run(wait())
    finally:
        proxy_action()


def test_a_step_that_fails_transiently_once_is_retried_and_the_flow_succeeds(
    prefect_harness, make_spec, tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    from tasks.acceptance.outage import TcpProxy
    from tasks.capacity.record import read_plan

    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port))
    try:
        spec = _spec(
            make_spec,
            tmp_path,
            {
                "storage": {"s3_endpoint_url": proxy.url, "options": {"config_kwargs": {"retries": _ONE_ATTEMPT}}},
                "data": {
                    "dataset_url": None,
                    "prepare": {"output_url": f"s3://{s3_bucket}/datasets", "builtin_corpus": "python-docs",
                                "builtin_max_bytes": 100_000, "tokenizer": {"kind": "bytes"}, "workers": 1},
                },
            },
            "flaky",
        )  # fmt: skip
        # Storage answers the preflight (load_spec checks every URL), goes down once the steps run, so the data
        # step's first attempt fails, and comes back once Prefect has scheduled the retry.
        outage = threading.Thread(
            target=_when_task, args=(proxy.down, "estimate_capacity", lambda name: True), daemon=True
        )
        restore = threading.Thread(
            target=_when_task, args=(proxy.up, "prepare_data", lambda name: name == "AwaitingRetry"), daemon=True
        )
        outage.start()
        restore.start()
        state, runs = _run(spec)
        outage.join(timeout=5)
        restore.join(timeout=5)
    finally:
        proxy.close()
    assert state.is_completed(), state.message
    assert runs["prepare_data"].run_count == 2 and runs["prepare_data"].state.is_completed()
    assert "| data preprocessing and validation | passed |" in _artifact("deployment-summary")
    assert read_plan(str(tmp_path / "flaky" / "plan.json")).fits
    assert (tmp_path / "flaky" / "node-check.json").exists()
    # acceptance ran in its own run workspace under the deployment's folder, and latest.json names it
    workspace = Path(state.result()["acceptance"].root)
    assert workspace.parent == tmp_path / "flaky" / "acceptance"
    assert json.loads((workspace.parent / "latest.json").read_text())["root"] == str(workspace)
    assert json.loads((workspace / "acceptance.json").read_text())["verdict"] == "passed"
    assert (workspace / "drills" / "acceptance.json").exists()


def _flow_run_parameters(flow_run_id) -> dict:  # noqa: ANN001
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).parameters


def test_a_bad_spec_file_fails_at_once_with_a_diagnosis_and_a_summary_that_name_the_field(
    prefect_harness, tmp_path: Path
) -> None:
    import yaml

    from tests.conftest import TINY_SPEC, deep_merge

    bad = deep_merge(TINY_SPEC, {"parallel": {"micro_batch": 0}, "data": {"dataset_url": str(tmp_path / "d")}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    state, runs = _run(str(path))
    assert state.is_failed()
    assert runs["load_spec"].state.is_failed() and runs["load_spec"].run_count == 1, "a spec error is never retried"
    assert "estimate_capacity" not in runs
    diagnosis = _artifact("diagnosis")
    assert "**invalid deployment spec**" in diagnosis and "parallel.micro_batch=0: must be >= 1" in diagnosis
    summary = _artifact("deployment-summary")
    assert "| spec validation | **FAILED** |" in summary and "parallel.micro_batch=0: must be >= 1" in summary
    assert "| capacity estimation | not run |" in summary


def test_a_secret_in_the_spec_parameter_is_refused_and_redacted_from_the_stored_parameters(
    prefect_harness, tmp_path: Path
) -> None:
    from tests.conftest import TINY_SPEC, deep_merge

    paths = {"data": {"dataset_url": str(tmp_path / "d")}, "checkpoint": {"url": str(tmp_path / "c")}}
    secret = {"storage": {"options": {"client_kwargs": {"aws_secret_access_key": "hunter2-in-db"}}}}
    data = deep_merge(deep_merge(TINY_SPEC, paths), {**secret, "run": {"output_url": str(tmp_path / "o")}})
    state, runs = _run(data)
    assert state.is_failed() and runs["load_spec"].run_count == 1
    stored = _flow_run_parameters(state.state_details.flow_run_id)
    assert stored["spec"]["storage"]["options"]["client_kwargs"] == {"aws_secret_access_key": "<redacted>"}
    assert stored["spec"]["model"] == TINY_SPEC["model"]  # the rest of the parameter is kept for the record
    field = "storage.options.client_kwargs.aws_secret_access_key=<redacted>: looks like a credential"
    for key in ("diagnosis", "deployment-summary"):
        assert field in _artifact(key) and "hunter2" not in _artifact(key)
    assert "hunter2" not in str(state.message)


def test_the_nightly_flow_also_diagnoses_a_bad_spec_without_retrying_it(prefect_harness, tmp_path: Path) -> None:
    from flows.nightly import nightly_validation
    from tests.conftest import TINY_SPEC, deep_merge

    bad = deep_merge(TINY_SPEC, {"optim": {"lr_peak": float("inf")}, "data": {"dataset_url": str(tmp_path / "d")}})
    state = nightly_validation(bad, return_state=True)
    runs = {r.name.rsplit("-", 1)[0]: r for r in _task_runs(state.state_details.flow_run_id)}
    assert state.is_failed() and runs["load_spec"].run_count == 1 and "run_acceptance" not in runs
    assert "optim.lr_peak=Infinity: must be a finite number" in _artifact("diagnosis")
    assert "| spec validation | **FAILED** |" in _artifact("deployment-summary")
