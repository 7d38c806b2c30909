"""The regression gate on hand-made figures: a throughput drop or a changed loss curve fails naming both values;
figures within the limits pass; no baseline yet passes and says so."""

from __future__ import annotations

from tasks.ledger.config import RegressionConfig
from tasks.ledger.gate import check_regression
from tasks.ledger.registry import Ledger
from tests.unit.ledger.conftest import CURVE_KEY, figures
from validation.acceptance import AcceptanceThresholds

LIMITS = AcceptanceThresholds()


def test_tokens_per_s_15_percent_below_the_baseline_fails_naming_both_values(ledger: Ledger, make_entry) -> None:
    base = make_entry()
    result = check_regression(ledger, base, figures(tokens_per_s=850.0), CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is False
    assert f"tokens/s 850 is 15% below the baseline's 1000 (entry {base.entry_id}; allowed 10%)" in result.message
    assert result.measured["tokens_per_s"]["verdict"] == "FAIL"
    assert result.evidence["baseline_entry"] == base.entry_id


def test_a_changed_loss_curve_at_the_same_seed_fails(ledger: Ledger, make_entry) -> None:
    base = make_entry()
    worse = figures(loss_curve={s: 5.0 - 0.05 * s for s in range(1, 21)}, val_loss=3.6)
    result = check_regression(ledger, base, worse, CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is False
    assert "loss curve at the same seed" in result.message and "3.6000" in result.message
    assert "3.0000" in result.message


def test_figures_within_the_limits_pass(ledger: Ledger, make_entry) -> None:
    base = make_entry()
    run = figures(tokens_per_s=950.0, step_time_s=0.52, checkpoint_save_s=3.0, val_loss=3.01)
    result = check_regression(ledger, base, run, CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is True, result.message
    verdicts = {name: v["verdict"] for name, v in result.measured.items()}
    for name in ("tokens_per_s", "step_time_s", "checkpoint_save_s", "loss_curve"):
        assert verdicts[name] == "pass", verdicts
    assert verdicts["comm_share"] == "not judged"  # no limit by default


def test_without_a_baseline_the_gate_passes_and_says_the_run_becomes_it(ledger: Ledger) -> None:
    result = check_regression(ledger, None, figures(), CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is True
    assert result.message == "no baseline; this run becomes it when accepted"


def test_timings_below_the_noise_floor_are_shown_but_not_judged(ledger: Ledger, make_entry) -> None:
    base = make_entry(figures=figures(step_time_s=0.01))
    result = check_regression(ledger, base, figures(tokens_per_s=500.0), CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is True
    expected = {"baseline": 1000.0, "run": 500.0, "change": -0.5, "verdict": "not judged"}
    assert result.measured["tokens_per_s"] == expected


def test_another_curve_identity_leaves_the_loss_curve_unjudged(ledger: Ledger, make_entry) -> None:
    base = make_entry()
    result = check_regression(ledger, base, figures(val_loss=9.0), "0" * 64, RegressionConfig(), LIMITS)
    assert result.passed is True
    assert result.measured["loss_curve"]["verdict"] == "not judged"


def test_bus_bandwidth_measured_over_a_short_interval_is_shown_but_not_judged(ledger: Ledger, make_entry) -> None:
    short = make_entry(figures=figures(busbw_gbps=1.112, busbw_timed_s=0.019))
    result = check_regression(ledger, short, figures(busbw_gbps=0.721), CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is True, result.message
    assert result.measured["busbw_gbps"]["verdict"] == "not judged"
    long = make_entry(figures=figures(busbw_gbps=1.112, busbw_timed_s=1.5))
    result = check_regression(ledger, long, figures(busbw_gbps=0.721), CURVE_KEY, RegressionConfig(), LIMITS)
    assert result.passed is False
    assert "bus bandwidth 0.721 GB/s is 35% below the baseline's 1.11 GB/s" in result.message
