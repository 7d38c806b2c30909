"""Live recovery through the Slurm launcher on a real multi-node Slurm cluster (hosts in namespaces, one slurmd
each): with fault_tolerance.mode=replica_groups each node runs one replica group under a torchft lighthouse on the
head node; a group whose ranks are SIGKILLed on its host is restarted by its torchrun and heals from the other
group over the network, which never reloads."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.replica_loss import drill_replica_loss
from tasks.launch.base import JobHandle, JobState
from tasks.launch.environment import JobEnvironment
from tasks.launch.slurm import SlurmLauncher
from tests.faults.job import injected
from tests.integration.multinode.conftest import HOST_NAMES, SlurmMultinode
from training.failure import read_failure
from training.preemption import read_records
from training.recovery_record import recovery_events
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


def _until_step(launcher: SlurmLauncher, handle: JobHandle, out: RunOutput, step: int, timeout_s: float = 240) -> int:
    """Wait until `out` recorded `step` while the job runs; the step it reached."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out.metric_ranks() and out.last_step() >= step:
            return out.last_step()
        status = launcher.status(handle)
        assert not status.state.terminal, (status.describe(), "\n".join(launcher.logs(handle)[0][-60:]))
        time.sleep(0.2)
    raise AssertionError(f"{out} did not reach step {step} in {timeout_s} s")


def test_through_slurm_a_killed_replica_group_heals_from_the_group_on_the_other_node(
    slurm_multinode: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in slurm_multinode.env.items():
        monkeypatch.setenv(key, value)
    shared = slurm_multinode.hosts.shared / "replica-groups"
    spec = make_spec({
        "cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                    "env": {"GLOO_SOCKET_IFNAME": "eth0"}},  # the hosts' link to each other (lo is per host)
        "run": {"steps": 150, "log_every_steps": 1, "output_url": str(shared / "output")},
        "checkpoint": {"url": str(shared / "checkpoints"), "save_every_steps": 1000},
        "fault_tolerance": {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 1.0},
    })  # fmt: skip
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = SlurmLauncher(slurm_multinode.env)
    handle = launcher.submit(spec.cluster, train, "tdeploy-replica-groups")
    try:
        healthy, lost = RunOutput(out / "replica-0"), RunOutput(out / "replica-1")
        killed_at = _until_step(launcher, handle, lost, 8)
        victims = lost.ranks().ranks
        for rank in victims:
            launcher.kill_rank(handle, rank, signal.SIGKILL)
        status = launcher.wait(handle, timeout_s=300)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    log = "\n".join(launcher.logs(handle)[0][-80:])
    assert status.state is JobState.SUCCEEDED, (status.describe(), log, slurm_multinode.logs())
    hosts = {r["host"] for g in (0, 1) for r in RunOutput(out / f"replica-{g}").ranks().ranks}
    assert hosts <= set(HOST_NAMES) and len(hosts) == 2, hosts  # one group per node
    live = [e for e in recovery_events(str(lost.dir)) if e.rung == "live"]
    assert len(live) == 1 and live[0].restored_step >= killed_at, (recovery_events(str(lost.dir)), log)
    assert [e.attempt for e in recovery_events(str(healthy.dir))] == [0]  # the healthy group never reloaded
    assert RunOutput(out).result() == healthy.result() and healthy.result().steps == 150
    assert lost.params() and {r: p.pieces for r, p in lost.params().items()} == {
        r: p.pieces for r, p in healthy.params().items()
    }


def _spec(slurm: SlurmMultinode, make_spec, name: str, steps: int):
    shared = slurm.hosts.shared / name
    return make_spec({
        "cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                    "env": {"GLOO_SOCKET_IFNAME": "eth0"}},
        "run": {"steps": steps, "log_every_steps": 1, "output_url": str(shared / "output")},
        "checkpoint": {"url": str(shared / "checkpoints"), "save_every_steps": 1000},
        "fault_tolerance": {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 1.0},
    }, name=name)  # fmt: skip


def test_through_slurm_the_time_limit_warning_checkpoints_every_group_and_the_job_requeues_and_finishes(
    slurm_multinode: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in slurm_multinode.env.items():
        monkeypatch.setenv(key, value)
    spec = _spec(slurm_multinode, make_spec, "replica-preempt", steps=40)
    train = spec.training_config()
    out = Path(train.run.output_url)
    launcher = SlurmLauncher(slurm_multinode.env)
    faults = injected(slow_rank=0, slow_step_s=0.3)  # rank 0 of each group: the warning arrives mid-run
    handle = launcher.submit(spec.cluster, train, "tdeploy-replica-preempt", environment=faults)
    try:
        _until_step(launcher, handle, RunOutput(out / "replica-1"), 3)
        # Slurm's time-limit warning (--signal=B:USR1@grace) goes to the batch shell only: sent here by hand
        launcher._run("scancel", "--batch", "--signal=USR1", handle.job_id)
        status = launcher.wait(handle, timeout_s=300)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    log = "\n".join(launcher.logs(handle)[0])  # both runs of the job: the log is appended to
    assert status.state is JobState.SUCCEEDED, (status.describe(), log[-5000:])
    assert "tdeploy: checkpointed on the signal; requeueing job" in log and launcher.restarts(handle) == 1
    (record,) = read_records(train.run.output_url)  # group 0's, surfaced under the job's id
    assert record.run_id == handle.job_id and 3 <= record.step < 40, record
    assert RunOutput(out).result() == RunOutput(out / "replica-0").result()
    assert RunOutput(out).result().steps == 40


def test_through_slurm_a_nan_loss_in_the_groups_fails_the_job_with_the_failure_record(
    slurm_multinode: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in slurm_multinode.env.items():
        monkeypatch.setenv(key, value)
    spec = _spec(slurm_multinode, make_spec, "replica-nan", steps=30)
    train = spec.training_config()
    launcher = SlurmLauncher(slurm_multinode.env)
    environment = JobEnvironment().with_drill_points(nan_loss={"step": 3})
    handle = launcher.submit(spec.cluster, train, "tdeploy-replica-nan", environment=environment)
    try:
        status = launcher.wait(handle, timeout_s=240)
    finally:
        if not launcher.status(handle).state.terminal:
            launcher.cancel(handle)
    log = "\n".join(launcher.logs(handle)[0])
    assert status.state is JobState.FAILED, (status.describe(), log[-3000:])
    found = read_failure(train.run.output_url)  # the job's own output, where the restart policy reads it
    assert found is not None and (found.cause, found.step) == ("nan_loss", 3)
    assert "replica group" in log and "exited" in log


def test_the_replica_loss_drill_passes_through_slurm_across_nodes(
    slurm_multinode: SlurmMultinode, make_spec, monkeypatch: pytest.MonkeyPatch, record_property
) -> None:
    for key, value in slurm_multinode.env.items():
        monkeypatch.setenv(key, value)
    spec = make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                                  "env": {"GLOO_SOCKET_IFNAME": "eth0"}}})  # fmt: skip
    acceptance = AcceptanceConfig(steps=12, save_every_steps=100, job_timeout_s=300)
    ctx = DrillContext(spec.cluster, spec.training_config(), slurm_multinode.hosts.shared / "drill", acceptance)
    result = drill_replica_loss(ctx)
    for figure in ("detection_s", "recovery_s", "steps_lost"):  # the figures, in --junitxml
        record_property(figure, getattr(result, figure))
    assert result.passed, (result.message, result.evidence, slurm_multinode.logs())
    assert result.steps_lost == 0 and result.state_matched
