"""The straggler rule on a busy host (issue 38, item 8), over the metrics record format: a rank that a shared host
deschedules takes longer in wall time but not in CPU time, so the rule judges the CPU time (the device's time on
GPUs) where the records carry it, and wall time only for records without it."""

from __future__ import annotations

import pytest

from training.run_output import StepRecord
from validation.acceptance import AcceptanceThresholds, check_performance, job_cpu_s, straggler_ratios

STEPS = 20
LIMITS = AcceptanceThresholds(scaling_efficiency_min=0.01, comm_share_max=1.0)
REFERENCE = {s: StepRecord(step=s, loss=3.0, tokens_per_s=1000.0) for s in range(1, STEPS + 1)}
TOKENS = 1024


def _rank(wall_s: float, cpu_s: float | None, device_s: float | None = None) -> dict[int, StepRecord]:
    """A rank's records: compute `wall_s` of wall time, `cpu_s` of process CPU time (None: not recorded, as on a
    GPU or in an older run), 2 ms of communication."""
    return {
        s: StepRecord(
            step=s,
            loss=3.0,
            tokens=TOKENS,
            tokens_per_s=TOKENS / (wall_s + 0.002),
            step_time_s=wall_s + 0.002,
            compute_s=wall_s,
            comm_s=0.002,
            data_wait_s=0.0,
            cpu_s=None if cpu_s is None else cpu_s + 0.001,
            compute_cpu_s=cpu_s,
            compute_device_s=device_s,
        )
        for s in range(1, STEPS + 1)
    }


def _judge(ranks: dict[int, dict[int, StepRecord]]):  # noqa: ANN202
    return check_performance(ranks, REFERENCE, len(ranks), LIMITS)


def test_a_rank_the_busy_host_descheduled_is_no_straggler_when_its_cpu_time_matches() -> None:
    # Rank 1 took 1.35x as long in wall time (the TP2xDP2+SP run of the issue), computing as much as rank 0.
    ranks = {0: _rank(0.010, 0.008), 1: _rank(0.0135, 0.008)}
    assert straggler_ratios(ranks, list(range(3, STEPS + 1)))[1] == pytest.approx(1.35)  # wall time would flag it
    perf = _judge(ranks)
    assert perf.passed, perf.message
    assert perf.measured["straggler_basis"] == "compute_cpu_s"
    assert perf.measured["straggler_ratio_per_rank"] == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}
    assert perf.measured["slow_rank"] is None


def test_a_rank_that_computes_longer_in_cpu_time_is_still_the_straggler_and_the_line_says_by_what() -> None:
    perf = _judge({0: _rank(0.010, 0.008), 1: _rank(0.010, 0.012)})
    assert not perf.passed and perf.measured["slow_rank"] == 1
    assert perf.measured["straggler_ratio_per_rank"][1] == pytest.approx(1.5)
    assert "rank 1 computes 0.012 s/step, 1.50x the other ranks' median (0.008 s of CPU time" in perf.message


def test_device_time_is_preferred_where_the_records_carry_it() -> None:
    # A GPU run: no CPU time (the host's says nothing of the device), wall time 1.6x on rank 1, device time equal.
    ranks = {0: _rank(0.010, None, device_s=0.009), 1: _rank(0.016, None, device_s=0.009)}
    perf = _judge(ranks)
    assert perf.passed, perf.message
    assert perf.measured["straggler_basis"] == "compute_device_s"


def test_records_without_cpu_or_device_time_are_judged_by_wall_time_as_before() -> None:
    perf = _judge({0: _rank(0.010, None), 1: _rank(0.015, None)})
    assert perf.measured["straggler_basis"] == "compute_s"
    assert not perf.passed and perf.measured["slow_rank"] == 1
    assert "of wall time" in perf.message


def test_a_rank_without_cpu_time_sends_the_whole_judgement_to_wall_time() -> None:
    # Mixed records cannot be compared: CPU time of one rank against wall time of another would invent a lag.
    ranks = {0: _rank(0.010, 0.004), 1: _rank(0.010, None)}
    assert _judge(ranks).measured["straggler_basis"] == "compute_s"


def test_throughput_by_cpu_time_follows_the_slowest_rank_and_its_interval_is_the_cpu_seconds() -> None:
    ranks = {0: _rank(0.030, 0.008), 1: _rank(0.030, 0.016)}
    steps = list(range(3, STEPS + 1))
    assert job_cpu_s(ranks, steps) == {s: pytest.approx(0.017) for s in steps}
    measured = _judge(ranks).measured
    assert measured["tokens_per_cpu_s"] == pytest.approx(TOKENS / 0.017)
    assert measured["step_cpu_s"] == pytest.approx(0.017)
    assert measured["cpu_timed_s"] == pytest.approx(0.017 * len(steps))
    assert measured["timed_s"] == pytest.approx(0.032 * len(steps))
    assert _judge({0: _rank(0.03, None), 1: _rank(0.03, None)}).measured["tokens_per_cpu_s"] is None


def _swinging(base_cpu_s: float, ratios: list[float]) -> dict[int, StepRecord]:
    """A rank whose CPU time per step is `base_cpu_s` times each of `ratios` in turn (contention that comes and goes)."""
    steady = _rank(0.010, base_cpu_s)
    return {
        s: StepRecord(**{**record.__dict__, "compute_cpu_s": base_cpu_s * ratios[s % len(ratios)]})
        for s, record in steady.items()
    }


def test_a_ratio_above_the_limit_only_by_the_runs_own_step_to_step_noise_is_no_straggler() -> None:
    # Rank 1's ratio swings between 1.0x and 2.2x from step to step (a neighbour taking the core now and then): its
    # median is above 1.25, the floor its spread supports is not.
    noisy = {0: _rank(0.010, 0.008), 1: _swinging(0.008, [1.0, 2.2, 1.05, 1.9, 1.1, 1.5])}
    perf = _judge(noisy)
    assert perf.measured["straggler_ratio_per_rank"][1] > LIMITS.straggler_ratio_max
    assert perf.measured["straggler_ratio_floor_per_rank"][1] < LIMITS.straggler_ratio_max
    assert perf.passed and perf.measured["stragglers_within_noise"] == [1], perf.message


def test_a_rank_slower_in_every_step_is_a_straggler_however_its_ratio_wobbles() -> None:
    steady = {0: _rank(0.010, 0.008), 1: _swinging(0.008, [1.45, 1.5, 1.55, 1.5])}
    perf = _judge(steady)
    assert perf.measured["straggler_ratio_floor_per_rank"][1] > LIMITS.straggler_ratio_max
    assert not perf.passed and perf.measured["slow_rank"] == 1
    assert "within its step-to-step noise" in perf.message
