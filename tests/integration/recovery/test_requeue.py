"""Rung 5 on the local launcher: an infrastructure failure is requeued by the launch step (no other host to leave
out here), and a requeue that makes no progress is stopped with the steps before and after in its decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch.step import JobInputs, run
from tasks.launch.submit import JobFailed
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.quarantine import NodeMemory
from tasks.recovery.record import read_decisions
from tests.faults.job import injected
from training.run_output import RunOutput

pytestmark = pytest.mark.integration


def test_a_crash_that_recurs_at_the_same_step_is_requeued_once_then_stopped_for_want_of_progress(
    make_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))
    spec = make_spec({"run": {"steps": 6}, "checkpoint": {"save_every_steps": 2}})
    train = spec.training_config()
    memory_url = str(tmp_path / "ledger" / "nodes")
    inputs = JobInputs(cluster=spec.cluster, train=train, name="crash", recovery=RecoveryConfig(requeues=3),
                       node_memory_url=memory_url)  # fmt: skip
    with pytest.raises(JobFailed) as caught:  # every launch of the job crashes on rank 1 after step 3
        run(inputs, environment=injected(crash_at_step=3, crash_rank=1))

    first, second = read_decisions(train.run.output_url)
    # the root cause is the rank's RuntimeError, or its abort on the way out (SIGABRT), whichever torchrun saw
    # first: neither is the workload's (a RuntimeError may be the machine's) nor blames a host
    assert (first.failure_class, first.action, first.requeue) == ("infrastructure", "requeue", 1)
    assert first.cause in ("unknown", "rank_crash") and first.blamed_hosts == first.excluded_hosts == []
    assert (second.action, second.step_before, second.step_now) == ("stop", 3, 3)
    assert "no progress since the last restart" in second.why
    assert caught.value.decision == second and "no progress" in str(caught.value)
    assert NodeMemory(memory_url, inputs.recovery).states() == {}
    # the requeue resumed from the checkpoint of step 2 and trained step 3 again, and nothing past it
    assert max(RunOutput(train.run.output_url).metrics()) == 3
