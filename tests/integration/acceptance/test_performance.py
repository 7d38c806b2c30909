"""The performance dimension on real 2-rank CPU runs (gloo): gradient sync that never ran, FSDP's communication.

The thresholds on throughput are loose (no timing thresholds in tests); what is checked is what the trainer
measured (comm_s per step) and which rule the judgement names.
"""

from __future__ import annotations


import pytest

from tasks.launch.local import run_local
from tests.faults.job import injected
from training.run_output import RunOutput
from validation.acceptance import AcceptanceThresholds, check_performance

pytestmark = pytest.mark.integration

LOOSE = AcceptanceThresholds(scaling_efficiency_min=0.01, comm_share_max=1.0, straggler_ratio_max=100.0)
SHORT = {"run": {"steps": 8}, "checkpoint": {"save_every_steps": None, "save_at_end": False}}


def _judged(spec, faults: dict | None = None):  # noqa: ANN001, ANN202
    """Run `spec` (2 ranks) with `faults`; its per-rank metrics and the performance judgement (rank 0's
    throughput stands in for the reference's: only the communication rules matter here)."""
    environment = injected(**faults) if faults else None
    job = run_local(spec.cluster, spec.training_config(), environment=environment)
    metrics = RunOutput(job.output_dir).all_metrics()
    perf = check_performance(metrics, metrics[0], 2, LOOSE, sharding=spec.parallel.sharding)
    return metrics, perf


def test_a_ddp_job_that_never_synchronises_gradients_is_flagged(make_spec) -> None:
    metrics, perf = _judged(make_spec(SHORT), {"skip_grad_sync": True})
    assert all(m.comm_s == 0.0 for rank in metrics.values() for m in rank.values())
    assert not perf.passed
    assert "no gradient synchronisation measured" in perf.message and "8 of 8 steps on rank 0" in perf.message


def test_fsdp_communication_is_measured_on_every_step_and_passes_the_comm_rule(make_spec) -> None:
    metrics, perf = _judged(make_spec({**SHORT, "parallel": {"sharding": "fsdp"}}))
    assert sorted(metrics) == [0, 1]
    for rank, steps in metrics.items():
        assert sorted(steps) == list(range(1, 9)), rank
        assert all(m.comm_s is not None and m.comm_s > 0 for m in steps.values()), (rank, steps)
        assert all(m.compute_s + m.comm_s <= m.step_time_s + 1e-9 for m in steps.values())
    assert perf.passed, perf.message
    assert 0 < perf.measured["comm_share"] < 1
