"""The performance dimension's rules on synthetic metrics: stragglers by ratio, and gradient sync that never ran."""

from __future__ import annotations

import dataclasses

import pytest

from training.run_output import StepRecord
from validation.acceptance import AcceptanceThresholds, check_performance, straggler_ratios

STEPS = 20
LIMITS = AcceptanceThresholds(scaling_efficiency_min=0.01, comm_share_max=1.0)


def _rank(compute_s: float, comm_s: float | None = 0.002, steps: int = STEPS) -> dict[int, StepRecord]:
    step_time = compute_s + (comm_s or 0.0)
    return {
        s: StepRecord(
            step=s,
            loss=3.0,
            tokens_per_s=1000.0,
            step_time_s=step_time,
            compute_s=compute_s,
            comm_s=comm_s,
            data_wait_s=0.0,
        )
        for s in range(1, steps + 1)
    }


REFERENCE = {s: StepRecord(step=s, loss=3.0, tokens_per_s=1000.0) for s in range(1, STEPS + 1)}


def _judge(ranks: dict[int, dict[int, StepRecord]], sharding: str = "ddp"):  # noqa: ANN202
    return check_performance(ranks, REFERENCE, len(ranks), LIMITS, sharding=sharding)


def test_a_rank_one_and_a_half_times_slower_is_named_with_the_default_threshold() -> None:
    perf = _judge({0: _rank(0.010), 1: _rank(0.015)})
    assert not perf.passed and perf.measured["slow_rank"] == 1
    assert perf.measured["straggler_ratio_per_rank"][1] == pytest.approx(1.5)
    assert "rank 1 computes 0.015 s/step, 1.50x the other ranks' median" in perf.message
    assert "rank 1's host" in perf.look_first
    assert perf.threshold["straggler_ratio_max"] == 1.25


def test_a_rank_one_point_one_times_slower_passes() -> None:
    perf = _judge({0: _rank(0.010), 1: _rank(0.011)})
    assert perf.passed, perf.message
    assert perf.measured["slow_rank"] is None
    assert perf.measured["straggler_ratio_per_rank"][1] == pytest.approx(1.1)


def test_the_straggler_is_judged_against_the_other_ranks_not_against_a_median_that_includes_it() -> None:
    # Two ranks: the median of both (0.0125) would make the slow one 1.2x, under the threshold; against the
    # other rank it is 1.5x, and the fast rank reads 1/1.5.
    ratios = straggler_ratios({0: _rank(0.010), 1: _rank(0.015)}, list(range(1, STEPS + 1)))
    assert ratios[1] == pytest.approx(1.5) and ratios[0] == pytest.approx(1 / 1.5)
    perf = _judge({0: _rank(0.010), 1: _rank(0.010), 2: _rank(0.010), 3: _rank(0.015)})
    assert not perf.passed and perf.measured["slow_rank"] == 3
    assert perf.measured["straggler_ratio_per_rank"][3] == pytest.approx(1.5)


def test_load_that_slows_every_rank_in_some_steps_does_not_make_a_straggler() -> None:
    # A quiet phase and a busy phase of the host (both ranks 4x slower), and two hiccups of rank 1 in between:
    # the ranks' median compute times land in different phases (4x apart), yet rank 1 was slower than rank 0
    # in 2 of 20 steps only.
    pairs = [(0.010, 0.010)] * 9 + [(0.010, 0.040)] * 2 + [(0.040, 0.040)] * 9
    rank0, rank1 = _rank(0.010), _rank(0.010)
    for s, (c0, c1) in enumerate(pairs, start=1):
        rank0[s] = dataclasses.replace(rank0[s], compute_s=c0)
        rank1[s] = dataclasses.replace(rank1[s], compute_s=c1)
    limits = LIMITS.model_copy(update={"warmup_steps_ignored": 0})
    perf = check_performance({0: rank0, 1: rank1}, REFERENCE, 2, limits)
    assert perf.measured["compute_s_per_rank"] == {0: 0.010, 1: 0.040}
    assert perf.passed, perf.message
    assert perf.measured["straggler_ratio_per_rank"] == {0: 1.0, 1: 1.0}


def test_a_stricter_threshold_from_the_spec_flags_a_smaller_lag() -> None:
    limits = LIMITS.model_copy(update={"straggler_ratio_max": 1.05})
    perf = check_performance({0: _rank(0.010), 1: _rank(0.011)}, REFERENCE, 2, limits)
    assert not perf.passed and perf.measured["slow_rank"] == 1


def test_zero_communication_in_a_multi_rank_ddp_job_is_no_gradient_synchronisation() -> None:
    perf = _judge({0: _rank(0.010, comm_s=0.0), 1: _rank(0.010, comm_s=0.0)})
    assert not perf.passed
    assert "no gradient synchronisation measured" in perf.message
    assert f"{STEPS} of {STEPS} steps on rank 0" in perf.message
    assert "gradient synchronisation" in perf.look_first


def test_one_step_without_communication_is_flagged_too() -> None:
    rank1 = _rank(0.010)
    rank1[7] = dataclasses.replace(rank1[7], comm_s=0.0)
    perf = _judge({0: _rank(0.010), 1: rank1})
    assert not perf.passed and "1 of 20 steps on rank 1" in perf.message


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_no_communication_measured_in_a_multi_rank_job_is_flagged(sharding: str) -> None:
    perf = _judge({0: _rank(0.010, comm_s=None), 1: _rank(0.010, comm_s=None)}, sharding)
    assert not perf.passed
    assert "no gradient synchronisation measured: ranks 0, 1 recorded no communication time" in perf.message


def test_hsdp_without_a_measurement_is_not_flagged() -> None:
    # One rank per shard group synchronises through an all-reduce the timer does not see (training/metrics.py).
    perf = _judge({0: _rank(0.010, comm_s=None), 1: _rank(0.010, comm_s=None)}, "hsdp")
    assert perf.passed, perf.message


def test_a_single_rank_job_is_not_flagged_for_having_no_communication() -> None:
    perf = _judge({0: _rank(0.010, comm_s=None)})
    assert perf.passed, perf.message
    assert perf.measured["slow_rank"] is None


def test_a_clean_two_rank_job_passes() -> None:
    perf = _judge({0: _rank(0.010), 1: _rank(0.0102)})
    assert perf.passed, perf.message


def test_the_threshold_must_be_above_one() -> None:
    with pytest.raises(ValueError, match="straggler_ratio_max"):
        AcceptanceThresholds(straggler_ratio_max=1.0)
