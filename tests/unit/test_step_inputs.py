"""Each step's typed inputs: `Inputs.of(spec, ...)` survives the JSON round trip Prefect's cache key and result
store put it through, and the flow's step and the CLI command hand the step's logic the same inputs.

The step's logic is replaced by a recorder that keeps what it was handed and stops there (nothing runs: no
planner search, no Ansible, no build, no job, no server); the flow's steps run as their tasks' plain functions
(`.fn`) so that no Prefect server is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

import flows.deploy as deploy
from flows.cli import app
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge


class Stop(Exception):
    """Raised by a recorder: the step was reached with its inputs; nothing after it matters here."""


class Recorder:
    """Stands in for a step's logic: keeps the inputs it is handed (its first argument), then stops."""

    def __init__(self, returns: Any = None) -> None:
        self.seen: list[BaseModel] = []
        self.returns = returns

    def __call__(self, inputs: BaseModel, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(inputs)
        if self.returns is not None:
            return self.returns
        raise Stop(type(inputs).__name__)


def _spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> tuple[DeploymentSpec, str]:
    """A spec whose folders are under tmp_path (the current folder, so that the CLI's path checks pass), and its
    file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds").mkdir()
    data = deep_merge(
        TINY_SPEC,
        {
            "deployment_dir": str(tmp_path / "deploy"),
            "data": {"dataset_url": str(tmp_path / "ds")},
            "checkpoint": {"url": str(tmp_path / "checkpoints")},
            "run": {"output_url": str(tmp_path / "output")},
            **overrides,
        },
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return parse_spec(data, str(path)), str(path)


def _round_trips(inputs: BaseModel) -> None:
    assert type(inputs).model_validate(inputs.model_dump()) == inputs
    assert type(inputs).model_validate_json(inputs.model_dump_json()) == inputs


def _given_data(spec: DeploymentSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data step answers with the spec's own dataset, as checked (the CLI commands that train start with it)."""
    from tasks.prepare import step as data_step
    from tasks.prepare.step import DataResult

    result = DataResult(dataset_url=spec.data.dataset_url or "", reused=True, given=True)
    monkeypatch.setattr(data_step, "run", Recorder(returns=result))


def _cli(*args: str) -> None:
    out = CliRunner().invoke(app, list(args))
    assert isinstance(out.exception, Stop), out.output


def test_the_capacity_steps_inputs_round_trip_and_the_flow_and_tdeploy_plan_plan_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.capacity.step import CapacityInputs
    from tasks.capacity.task import estimate_capacity

    spec, path = _spec(tmp_path, monkeypatch)
    expected = CapacityInputs.of(spec)
    _round_trips(expected)
    assert expected.plan_url == f"{tmp_path / 'deploy'}/plan.json"
    recorder = Recorder()
    monkeypatch.setattr(CapacityInputs, "make", lambda self: recorder(self))
    monkeypatch.setattr(deploy, "plan_step", estimate_capacity.fn)
    with pytest.raises(Stop):
        deploy.RUNNERS["capacity"](deploy.Deployment(spec))
    _cli("plan", path)
    assert recorder.seen == [expected, expected]


def test_the_node_steps_inputs_round_trip_and_the_flow_and_tdeploy_check_nodes_check_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.nodes import step, task
    from tasks.nodes.step import NodesInputs

    spec, path = _spec(tmp_path, monkeypatch)
    expected = NodesInputs.of(spec)
    _round_trips(expected)
    assert expected.report_path == f"{tmp_path / 'deploy'}/node-check.json"
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(task, "run", recorder)
    monkeypatch.setattr(deploy, "check_nodes", task.check_nodes.fn)
    with pytest.raises(Stop):
        deploy.RUNNERS["nodes"](deploy.Deployment(spec))
    _cli("check-nodes", path)
    assert recorder.seen == [expected, expected]


def test_the_image_steps_inputs_round_trip_and_the_flow_and_tdeploy_build_image_build_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.image import step, task
    from tasks.image.step import ImageInputs

    spec, path = _spec(tmp_path, monkeypatch, cluster={"scheduler": "slurm"})
    assert spec.image is not None
    expected = ImageInputs.of(spec)
    _round_trips(expected)
    assert expected.record_dir == f"{tmp_path / 'deploy'}/image" and not expected.allow_skip
    assert ImageInputs.of(parse_spec(deep_merge(TINY_SPEC, {"data": {"dataset_url": "d"}}))).allow_skip
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(task, "run", recorder)
    monkeypatch.setattr(deploy, "image_step", task.build_image.fn)
    with pytest.raises(Stop):
        deploy.RUNNERS["image"](deploy.Deployment(spec))
    _cli("build-image", path)
    assert recorder.seen == [expected, expected]


def test_the_data_steps_inputs_round_trip_and_the_flow_and_tdeploy_prepare_data_prepare_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.prepare import step, task
    from tasks.prepare.step import DataInputs

    prepare = {"builtin_corpus": "python-docs", "tokenizer": {"kind": "bytes"}}
    spec, path = _spec(tmp_path, monkeypatch, data={"dataset_url": None, "prepare": prepare})
    expected = DataInputs.of(spec)
    _round_trips(expected)
    assert expected.prepare is not None and expected.prepare.output_url == f"{tmp_path / 'deploy'}/datasets"
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(task, "run", recorder)
    monkeypatch.setattr(deploy, "data_step", task.prepare_data.fn)
    with pytest.raises(Stop):
        deploy.RUNNERS["data"](deploy.Deployment(spec))
    _cli("prepare-data", path)
    assert recorder.seen == [expected, expected]


def test_the_job_steps_inputs_round_trip_and_the_deploy_and_rollout_flows_submit_the_same_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.launch import task
    from tasks.launch.step import JobInputs

    spec, _ = _spec(tmp_path, monkeypatch)
    train = spec.training_config()
    expected = JobInputs.of(spec, train, "registry.local/tdeploy@sha256:ab")
    _round_trips(expected)
    assert expected.wait_until == "finished" and expected.train == train
    recorder = Recorder()
    monkeypatch.setattr(task, "run", recorder)
    monkeypatch.setattr(deploy, "submit_job", task.submit_job.fn)
    image = {"pushed": True, "reference_by_digest": "registry.local/tdeploy@sha256:ab"}
    run = deploy.Deployment(spec, train=train)
    run.results["image"] = deploy.ImageStepResult(status="built", reason="new tag", record=image)
    with pytest.raises(Stop):
        deploy.RUNNERS["job"](run)
    assert recorder.seen == [expected]


def test_tdeploy_submit_hands_the_job_step_the_flows_inputs_detached_from_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.launch import step, task
    from tasks.launch.step import JobInputs

    spec, path = _spec(tmp_path, monkeypatch)
    _given_data(spec, monkeypatch)
    train = spec.training_config()
    flows_job = JobInputs.of(spec, train, IMAGE)
    watched = JobInputs.of(spec, train, IMAGE, detached=True)  # --wait: streamed until it ends, never stopped by us
    started = JobInputs.of(spec, train, IMAGE, "submitted", detached=True)
    _round_trips(watched)
    assert watched.model_copy(update={"detached": False}) == flows_job
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(task, "run", recorder)
    monkeypatch.setattr(deploy, "submit_job", task.submit_job.fn)
    run = deploy.Deployment(spec, train=train)
    image = {"pushed": True, "reference_by_digest": IMAGE}
    run.results["image"] = deploy.ImageStepResult(status="built", reason="new tag", record=image)
    with pytest.raises(Stop):
        deploy.RUNNERS["job"](run)
    _cli("submit", path, "--image", IMAGE, "--wait")
    _cli("submit", path, "--image", IMAGE)
    assert recorder.seen == [flows_job, watched, started]


def test_the_serving_steps_inputs_round_trip_and_the_flow_and_tdeploy_check_serving_check_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.capacity.step import serving_pod_memory
    from tasks.serve import step, task
    from tasks.serve.step import ServingInputs

    spec, path = _spec(tmp_path, monkeypatch, serve={}, model={"n_heads": 1, "n_kv_heads": 1})
    _given_data(spec, monkeypatch)
    train = spec.training_config()
    expected = ServingInputs.of(spec, train, pod_memory_bytes=serving_pod_memory(spec))
    assert expected.pod_memory_bytes and expected.pod_memory_bytes > 0  # the manifests' memory from the plan
    _round_trips(expected)
    deployment = tmp_path / "deploy"
    assert (expected.out_dir, expected.export_root) == (f"{deployment}/serving", f"{deployment}/export")
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(task, "run", recorder)
    monkeypatch.setattr(deploy, "serving_check", task.serving_check.fn)
    with pytest.raises(Stop):
        deploy.RUNNERS["serving"](deploy.Deployment(spec, train=train))
    _cli("check-serving", path)
    assert recorder.seen == [expected, expected]


def test_the_export_steps_inputs_round_trip_and_the_task_and_tdeploy_export_export_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.export import step, task
    from tasks.export.step import ExportInputs

    spec, path = _spec(tmp_path, monkeypatch)
    _given_data(spec, monkeypatch)
    expected = ExportInputs.of(spec, spec.training_config(), step=20)
    _round_trips(expected)
    assert expected.export_root == f"{tmp_path / 'deploy'}/export"
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(task, "run", recorder)
    with pytest.raises(Stop):
        task.export_model.fn(expected)
    _cli("export", path, "--step", "20")
    assert recorder.seen == [expected, expected]


RUN = "20260101T000000.000000Z-abcdef"
"""The one run id the acceptance workspaces get here, so that inputs made at different moments compare whole."""
IMAGE = "registry.local/tdeploy@sha256:ab"


def _one_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.acceptance import suite

    monkeypatch.setattr(suite, "new_run_id", lambda: RUN)


def test_the_acceptance_steps_inputs_round_trip_and_the_flow_and_tdeploy_accept_accept_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.acceptance import step, task
    from tasks.acceptance.step import AcceptanceStepInputs
    from tasks.capacity.step import CapacityInputs, CapacityResult
    from tasks.ledger.registry import Provenance

    spec, path = _spec(tmp_path, monkeypatch)
    _given_data(spec, monkeypatch)
    _one_run_id(monkeypatch)
    train = spec.training_config()
    planned = CapacityInputs.of(spec).planned()
    capacity = CapacityResult(plan_url="p", fits=True, layout="l", peak_bytes=1, usable_bytes=2, step_seconds=1.0,
                              planned=planned)  # fmt: skip
    built = deploy.ImageStepResult(
        status="built", reason="new tag", record={"pushed": True, "reference_by_digest": IMAGE}
    )
    expected = AcceptanceStepInputs.of(spec, train, image=built, capacity=capacity)
    _round_trips(expected)
    assert expected.root == f"{tmp_path / 'deploy'}/acceptance/{RUN}"
    assert (expected.image, expected.planned) == (IMAGE, planned)
    assert expected.provenance == Provenance(spec.name, spec.digest(), IMAGE, None)
    recorder = Recorder()
    monkeypatch.setattr(step, "run", recorder)
    monkeypatch.setattr(deploy, "run_acceptance", task.run_acceptance.fn)
    run = deploy.Deployment(spec, train=train)
    run.results |= {"capacity": capacity, "image": built}
    with pytest.raises(Stop):
        deploy.RUNNERS["acceptance"](run)
    _cli("accept", path, "--image", IMAGE)
    assert recorder.seen == [expected, expected]


def test_the_drills_steps_inputs_round_trip_and_the_flow_and_tdeploy_drill_drill_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.acceptance import step, task
    from tasks.acceptance.step import AcceptanceResult, DrillsInputs

    spec, path = _spec(tmp_path, monkeypatch)
    _given_data(spec, monkeypatch)
    _one_run_id(monkeypatch)
    train = spec.training_config()
    expected = DrillsInputs.of(spec, train)
    _round_trips(expected)
    _round_trips(DrillsInputs.of(spec, train, only=["rank_kill"]))
    root = f"{tmp_path / 'deploy'}/acceptance/{RUN}"
    assert (expected.root, expected.only, expected.drills) == (root, None, spec.drills)
    suite_only = {"mode", "with_drills", "planned", "provenance", "record", "deployment_dir"}
    assert not suite_only & set(DrillsInputs.model_fields)  # the drills' own inputs: nothing they would ignore
    recorder = Recorder()
    monkeypatch.setattr(step, "run_drills", recorder)
    monkeypatch.setattr(deploy, "run_drills", task.run_drills.fn)
    run = deploy.Deployment(spec, train=train)
    run.results["acceptance"] = AcceptanceResult(verdict_text="passed", files={}, report={}, root=root)
    with pytest.raises(Stop):
        deploy.RUNNERS["drills"](run)  # in the acceptance step's workspace, to reuse its runs
    _cli("drill", path)
    assert recorder.seen == [expected, expected]


def test_tdeploy_rollout_and_the_rollout_flow_accept_the_whole_deployment_with_the_same_planned_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flows.rollout as rollout
    from tasks.acceptance import step, task
    from tasks.prepare.step import DataResult
    from tasks.rollout import canary

    spec, path = _spec(tmp_path, monkeypatch)
    _given_data(spec, monkeypatch)
    _one_run_id(monkeypatch)
    recorder = Recorder()
    monkeypatch.setattr(canary, "run_canary", lambda *args, **kwargs: None)  # a passed canary
    monkeypatch.setattr(canary, "run_acceptance", recorder)
    _cli("rollout", path, "--image", IMAGE)
    given = DataResult(dataset_url=spec.data.dataset_url or "", reused=True, given=True)
    monkeypatch.setattr(rollout, "load_or_diagnose", lambda source: spec)
    monkeypatch.setattr(rollout, "data_task", lambda inputs: given)
    monkeypatch.setattr(rollout, "canary_rollout", lambda *args, **kwargs: None)
    monkeypatch.setattr(rollout, "diagnose_failure", lambda *args: {})
    monkeypatch.setattr(rollout, "run_acceptance", task.run_acceptance.fn)
    monkeypatch.setattr(step, "run", recorder)
    with pytest.raises(Stop):
        rollout.rollout.fn(IMAGE, path)
    cli, flow = recorder.seen
    assert flow.planned is not None and cli.planned == flow.planned
    assert cli == flow


def test_the_canarys_inputs_round_trip_and_tdeploy_rollout_and_the_flow_run_the_same_canary_with_the_deployment_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flows.rollout as rollout
    from tasks.paths import DeploymentPaths
    from tasks.prepare.step import DataResult
    from tasks.rollout import canary
    from tasks.rollout.canary import CanaryInputs

    spec, path = _spec(tmp_path, monkeypatch)
    _given_data(spec, monkeypatch)
    expected = CanaryInputs.of(spec, spec.training_config(), image=IMAGE)
    _round_trips(expected)
    assert expected.deployment_dir == DeploymentPaths.of(spec).deployment_dir == str(tmp_path / "deploy")
    recorder = Recorder()
    monkeypatch.setattr(canary, "run_canary", recorder)
    _cli("rollout", path, "--image", IMAGE)
    given = DataResult(dataset_url=spec.data.dataset_url or "", reused=True, given=True)
    monkeypatch.setattr(rollout, "load_or_diagnose", lambda source: spec)
    monkeypatch.setattr(rollout, "data_task", lambda inputs: given)
    monkeypatch.setattr(rollout, "canary_rollout", recorder)
    monkeypatch.setattr(rollout, "diagnose_failure", lambda *args: {})
    with pytest.raises(Stop):
        rollout.rollout.fn(IMAGE, path)
    assert recorder.seen == [expected, expected]

    # the canary's acceptance runs record the deployment's folder in the quality baseline they write
    monkeypatch.undo()
    suite = Recorder()
    monkeypatch.setattr(canary, "run_acceptance", suite)
    with pytest.raises(Stop):
        canary.run_canary(expected.model_copy(update={"image": "registry.local/tdeploy:new"}))
    (accepted,) = suite.seen
    assert accepted.deployment_dir == expected.deployment_dir
