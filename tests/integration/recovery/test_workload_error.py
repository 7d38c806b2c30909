"""A workload error (NaN loss) in a real torchrun job with restarts and requeues left: the job stops, the launch
step's restart policy decides stop, and nothing is retried."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.workload_error import drill_workload_error
from tasks.errors import retry_on_transient
from tasks.launch.base import JobState
from tasks.launch.environment import JobEnvironment
from tasks.launch.step import JobInputs, run
from tasks.launch.submit import JobFailed
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.quarantine import NodeMemory
from tasks.recovery.record import read_decisions
from training.failure import WORKLOAD_EXIT_CODE, read_failure
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

NAN_STEP = 5


def _nan_job(make_spec, steps: int = 8):  # noqa: ANN202 - a spec and its drill environment
    spec = make_spec({"cluster": {"max_restarts": 2}, "run": {"steps": steps},
                      "checkpoint": {"save_every_steps": 2}})  # fmt: skip
    return spec, JobEnvironment().with_drill_points(nan_loss={"step": NAN_STEP})


def test_a_nan_loss_stops_the_job_and_no_restart_or_requeue_trains_a_step(
    make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.states import Failed

    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec, environment = _nan_job(make_spec)
    train = spec.training_config()
    memory_url = str(tmp_path / "ledger" / "nodes")
    inputs = JobInputs(cluster=spec.cluster, train=train, name="nan", recovery=RecoveryConfig(requeues=2),
                       node_memory_url=memory_url)  # fmt: skip
    with pytest.raises(JobFailed) as caught:
        run(inputs, environment=environment)

    handle, decision = caught.value.handle, caught.value.decision
    assert caught.value.status.state is JobState.FAILED
    assert decision is not None and (decision.failure_class, decision.cause, decision.action) == (
        "workload", "nan_loss", "stop")  # fmt: skip
    assert read_decisions(train.run.output_url) == [decision]  # one job, one decision: no requeue
    assert NodeMemory(memory_url, inputs.recovery).states() == {}  # a workload error blames no host
    assert not retry_on_transient(None, None, Failed(data=caught.value))  # nor does the Prefect task retry it
    failure = read_failure(train.run.output_url)
    assert failure is not None and failure.cause == "nan_loss" and failure.step == NAN_STEP
    assert failure.failure_class == "workload" and failure.run_id == handle.job_id
    run_output = RunOutput(handle.output_dir)
    for rank in run_output.metric_ranks():
        steps = [r.step for r in run_output.metric_records(rank)]
        # every step once, none after the NaN: the restarts torchrun made (max_restarts=2) trained nothing
        assert steps == list(range(1, NAN_STEP + 1)), (rank, steps)
    assert {r["restart_count"] for r in run_output.ranks().ranks} == {0}  # no restarted worker built a trainer
    log = run_output.train_log.read_text()
    assert "not retried: workload error (nan_loss) at step 5" in log
    assert f"exitcode  : {WORKLOAD_EXIT_CODE}" in log  # the last attempt's workers refused with the distinct code


def test_with_the_stop_off_a_nan_loss_trains_on_to_the_end(make_spec, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec, environment = _nan_job(make_spec, steps=6)
    base = spec.training_config()
    train = base.model_copy(update={"run": base.run.model_copy(update={"stop_on_nonfinite_loss": False})})
    result = run(JobInputs(cluster=spec.cluster, train=train, name="nan-on"), environment=environment)
    assert result.state == "succeeded" and read_failure(train.run.output_url) is None
    assert max(RunOutput(result.output_dir).metrics()) == 6


def test_the_workload_error_drill_passes_on_the_local_launcher(make_spec, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec = make_spec({"run": {"steps": 10}})  # max_restarts=0 in the spec: the drill gives its job a restart
    acceptance = AcceptanceConfig(steps=10, save_every_steps=3, job_timeout_s=300)
    result = drill_workload_error(DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance))
    assert result.passed, (result.message, result.evidence)
    assert result.name == "workload_error" and result.steps_lost == 0 and result.detection_s is not None
    evidence = result.evidence
    assert evidence["nan_step"] == 4 and evidence["max_restarts"] == 1 and evidence["steps_after_failure"] == 0
    assert evidence["failure"]["class"] == "workload" and [d["action"] for d in evidence["decisions"]] == ["stop"]
