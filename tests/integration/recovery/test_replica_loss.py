"""Live recovery with real processes: two replica groups (torchrun each) under a torchft lighthouse, one killed."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tasks.acceptance.ladder.replica_loss import HEALTHY, LOST, run_replica_loss
from tasks.launch.cluster import ClusterConfig
from tasks.launch.lighthouse import ReplicaGroupsJob
from training.config import TrainConfig
from training.recovery_record import recovery_events
from training.replica import quorum_events
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

STEPS = 200


def _replica_config(make_spec, tmp_path: Path) -> TrainConfig:
    spec = make_spec({"run": {"steps": STEPS, "log_every_steps": 1}, "checkpoint": {"save_every_steps": 100}})
    raw = spec.training_config().model_dump()
    raw["fault_tolerance"] = {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 1.0}
    return TrainConfig.model_validate(raw)


def test_a_killed_replica_group_heals_from_its_peer_which_never_reloads(make_spec, tmp_path: Path) -> None:
    train = _replica_config(make_spec, tmp_path)
    cluster = ClusterConfig(scheduler="local", nodes=1, procs_per_node=2, accelerator="cpu")
    result = run_replica_loss(cluster, train, kill_at_step=8, timeout_s=240)
    assert result.passed, (result.message, result.evidence)
    assert result.steps_lost == 0 and result.state_matched
    assert result.detection_s is not None and result.recovery_s is not None

    healthy = RunOutput(Path(train.run.output_url) / f"replica-{HEALTHY}")
    lost = RunOutput(Path(train.run.output_url) / f"replica-{LOST}")
    # the healthy group started once and never restored again; the lost one restarted and pulled from a peer
    assert [e.attempt for e in recovery_events(str(healthy.dir))] == [0]
    live = [e for e in recovery_events(str(lost.dir)) if e.rung == "live"]
    assert len(live) == 1 and live[0].attempt == 1 and live[0].restored_step >= result.evidence["killed_at_step"]
    healed = [q for q in quorum_events(str(lost.dir)) if q.healed]
    assert [q.step for q in healed][-1] == live[0].restored_step
    # the healed group trained every later step
    assert [r.step for r in lost.metric_records()][-(STEPS - live[0].restored_step):] == list(
        range(live[0].restored_step + 1, STEPS + 1)
    )
    assert healthy.result().resumed_from_step is None and lost.result().resumed_from_step == live[0].restored_step
    # while the lost group was away the healthy one trained on alone, in a quorum of one
    alone = [q.step for q in quorum_events(str(healthy.dir)) if q.participants == 1]
    assert alone and alone[0] <= live[0].restored_step


def test_when_every_group_is_lost_they_restore_through_the_next_rung(make_spec, tmp_path: Path) -> None:
    train = _replica_config(make_spec, tmp_path)
    train = train.model_copy(update={"checkpoint": train.checkpoint.model_copy(update={"save_every_steps": 20})})
    job = ReplicaGroupsJob.start(train, tmp_path / "groups", procs_per_group=1, max_restarts=1)
    try:
        outputs = [job.output(g) for g in (HEALTHY, LOST)]
        deadline = time.monotonic() + 120
        while min(out.last_step() if out.metric_ranks() else 0 for out in outputs) < 30:
            assert time.monotonic() < deadline and all(p.poll() is None for p in job.groups), job.log_tail(0)
            time.sleep(0.1)
        t_fail = time.time()
        for g in (HEALTHY, LOST):
            job.kill_group(g, signal.SIGKILL)
        assert job.wait(240) == [0, 0], (job.log_tail(0), job.log_tail(1))
    finally:
        job.stop()
    after = {g: [e for e in recovery_events(str(out.dir)) if e.time > t_fail] for g, out in enumerate(outputs)}
    # no group had a peer to pull from at first: the first back restored the last checkpoint from storage (step 20),
    # the other restored it too or pulled from the first; none started over
    assert any(e.rung == "storage" and e.restored_step == 20 for events in after.values() for e in events), after
    assert all(e.rung in ("storage", "live") and e.attempt == 1 for events in after.values() for e in events), after
    assert all(out.result().steps == STEPS for out in outputs)
    params = [sorted((p.name, p.sha256) for p in out.params()[0].pieces) for out in outputs]
    assert params[0] == params[1]
