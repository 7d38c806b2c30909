"""benchmarks/recovery.py's own arithmetic: the stall read from step records, and the goals judged from the drills."""

from __future__ import annotations

import pytest

from benchmarks.recovery import Row, Stall, goals, snapshot_gaps, stall_of, verdict
from tasks.acceptance.record import DrillResult
from training.checkpoint.memory_auto import TierDecision
from training.run_output import StepRecord


def _steps(ends: list[float], step_s: float = 0.02) -> list[StepRecord]:
    """Records of steps 1.. that ended at `ends` (seconds), each `step_s` long."""
    return [StepRecord(step=k, loss=1.0, step_time_s=step_s, time_unix_s=t) for k, t in enumerate(ends, start=1)]


def test_a_gap_is_the_time_between_two_step_ends_less_the_later_steps_own_time() -> None:
    records = _steps([1.0, 1.025, 1.050, 1.080])  # steps 2..4 began 5, 5 and 10 ms after the previous one ended
    assert snapshot_gaps(records, None) == pytest.approx([0.005, 0.005, 0.010])
    assert snapshot_gaps(records, 3) == pytest.approx([0.010])  # only after the snapshot of step 3


def test_steps_without_a_time_and_steps_missing_after_a_restart_make_no_gap() -> None:
    records = _steps([1.0, 1.025, 1.050]) + [StepRecord(step=5, loss=1.0, step_time_s=0.02, time_unix_s=2.0)]
    records[1] = StepRecord(step=2, loss=1.0, step_time_s=0.02, time_unix_s=None)
    assert snapshot_gaps(records, None) == []  # 1->2 has no end time, 2->3 neither, 3->4 never ran


def test_the_stall_is_the_gap_after_a_snapshot_over_the_gap_without_copies_as_a_share_of_the_median_step() -> None:
    without = _steps([1.0 + 0.021 * k for k in range(6)])  # 1 ms between steps
    with_copies = _steps([1.0 + 0.025 * k for k in range(6)])  # 5 ms between steps
    stall = stall_of(1, with_copies, without)
    assert (stall.snapshots, stall.stall_s, stall.share) == (5, pytest.approx(0.004), pytest.approx(0.2))


def test_a_gap_shorter_than_without_copies_is_no_stall_and_too_few_steps_are_refused() -> None:
    assert Stall(1, 5, step_s=0.02, gap_s=0.001, base_gap_s=0.002).stall_s == 0.0
    with pytest.raises(ValueError, match="raise --stall-steps"):
        stall_of(5, _steps([1.0, 1.02]), _steps([1.0, 1.02]))


def test_a_figure_is_judged_met_up_to_its_limit_and_not_measured_is_neither() -> None:
    assert [verdict(10.0, 10.0), verdict(10.01, 10.0), verdict(None, 10.0)] == ["met", "not met", "-"]


def test_the_goals_judge_only_the_ladder_rungs_against_their_own_memory_interval() -> None:
    results = [
        (Row("storage (today)", "rank_kill", 5), DrillResult("rank_kill", True, recovery_s=30.0, steps_lost=4), 1.0),
        (Row("3 memory", "memory_restore", 1), DrillResult("memory_restore", True, recovery_s=6.0, steps_lost=1), 1.0),
        (Row("1 live", "replica_loss", 0), DrillResult("replica_loss", True, recovery_s=9.0, steps_lost=0), 1.0),
    ]
    chosen = TierDecision(5, True, 2, 4e6, 8e9, 1e6, stall_s=0.0015, step_s=0.02)
    stalls = [Stall(1, 9, step_s=0.02, gap_s=0.0025, base_gap_s=0.001), Stall(5, 2, 0.02, 0.03, 0.001),
              Stall(2, 4, step_s=0.02, gap_s=0.0035, base_gap_s=0.001, auto=chosen)]  # fmt: skip
    rto, rpo, stall = goals(results, stalls)
    assert rto.endswith("9.00 s -> met")  # today's 30 s is the baseline, not judged
    assert rpo.endswith(": 0 -> met")  # one step lost at a copy every step is within the interval
    # only the default interval (auto, which chose 2) is judged, per step: 2.5 ms per copy / 2 steps of 20 ms
    assert stall.endswith("(memory_every_steps=auto -> 2), per step: 6.2% -> not met")
    assert goals(results, stalls[:2])[2].endswith("-> -")  # no auto job: not measured
    results.append((Row("2 hot spare", "spare_takeover", 1), DrillResult("spare_takeover", False), 1.0))
    assert [line.rsplit(" ", 1)[-1] for line in goals(results, stalls)[:2]] == ["-", "-"]  # a rung not measured


def test_auto_is_read_at_the_interval_of_its_last_decision_from_that_step_on() -> None:
    records = _steps([1.0, 1.030, 1.055, 1.080, 1.110, 1.135])  # 10 ms after steps 1 and 4, 5 ms after the others
    assert snapshot_gaps(records, 1, after_step=2) == pytest.approx([0.005, 0.010, 0.005])
    chosen = TierDecision(3, True, 2, 4e6, 8e9, 1e6, stall_s=0.004, step_s=0.02)
    stall = stall_of(2, records, _steps([1.0 + 0.021 * k for k in range(6)]), chosen)
    assert (stall.snapshots, stall.gap_s, stall.auto) == (1, pytest.approx(0.010), chosen)  # after step 4 only
