"""The checkpoint interval's formulas (training/checkpoint/interval.py) against cases worked by hand."""

from __future__ import annotations

import math

import pytest

from training.checkpoint.interval import expected_waste, interval_steps, young_daly_s, young_s


def test_young_is_the_square_root_of_twice_the_stall_times_the_mtbf() -> None:
    # sqrt(2 x 2 s x 3600 s) = sqrt(14400) = 120 s
    assert young_s(2.0, 3600.0) == pytest.approx(120.0)


def test_daly_adds_its_corrections_to_young_and_subtracts_the_stall() -> None:
    # delta / 2M = 2 / 7200 = 1/3600, its root 1/60: 120 x (1 + 1/180 + 1/32400) - 2 = 118.67037...
    assert young_daly_s(2.0, 3600.0) == pytest.approx(120 + 120 / 180 + 120 / 32400 - 2, rel=1e-12)
    assert young_daly_s(2.0, 3600.0) == pytest.approx(118.6703704, rel=1e-9)


def test_daly_with_a_stall_of_a_quarter_of_twice_the_mtbf() -> None:
    # delta = 50, M = 100: delta / 2M = 1/4, root 1/2; 100 x (1 + 1/6 + 1/36) - 50 = 4300/36 - 50 = 625/9
    assert young_daly_s(50.0, 100.0) == pytest.approx(625 / 9, rel=1e-12)


def test_a_save_that_costs_twice_the_mtbf_or_more_gives_the_mtbf() -> None:
    assert young_daly_s(300.0, 100.0) == 100.0
    assert young_daly_s(200.0, 100.0) == 100.0


def test_a_free_save_is_worth_taking_every_step() -> None:
    assert young_daly_s(0.0, 3600.0) == 0.0
    assert interval_steps(0.0, 0.5, 3600.0) == 1


def test_interval_in_steps_rounds_the_optimum_and_keeps_to_the_bound() -> None:
    # 118.67 s / 0.5 s = 237.34 -> 237 steps
    assert interval_steps(2.0, 0.5, 3600.0) == 237
    assert interval_steps(2.0, 0.5, 3600.0, most=100) == 100


def test_no_interval_without_a_failure_rate_or_a_step_time() -> None:
    assert interval_steps(2.0, 0.5, None) is None
    assert interval_steps(2.0, 0.0, 3600.0) is None


def test_expected_waste_is_save_share_plus_half_an_interval_per_failure() -> None:
    # 2/120 + (120 + 2) / 7200 = 60/3600 + 61/3600 = 121/3600
    assert expected_waste(120.0, 2.0, 3600.0) == pytest.approx(121 / 3600, rel=1e-12)


def test_young_s_interval_is_where_the_first_order_waste_is_least() -> None:
    best = young_s(2.0, 3600.0)
    for other in (best / 2, best * 0.9, best * 1.1, best * 2):
        assert expected_waste(best, 2.0, 3600.0) < expected_waste(other, 2.0, 3600.0)


def test_bad_inputs_name_the_values() -> None:
    with pytest.raises(ValueError, match="mtbf_s=0"):
        young_daly_s(1.0, 0.0)
    with pytest.raises(ValueError, match="interval_s=0"):
        expected_waste(0.0, 1.0, 10.0)
    assert math.isfinite(young_daly_s(1e-9, 1e9))
