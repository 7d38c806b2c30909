"""The quality gate's rules on synthetic curves: against a baseline, and the sanity rule before one exists."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from training.run_output import RunOutputWriter, RunResult, StepRecord
from training.storage import StorageConfig
from validation.acceptance import AcceptanceThresholds, DimensionResult
from validation.quality import LossCurve, check_quality, loss_curve, not_measured, tail_steps, with_quality

LIMITS = AcceptanceThresholds(quality_max_rel_worse=0.02, quality_min_loss_drop_fraction=0.2)


def _falling(steps: int = 40, start: float = 5.5, end: float = 3.0, val: float | None = None) -> LossCurve:
    """A curve falling linearly from `start` to `end`; its validation loss is `val` (default: end)."""
    losses = {s: start + (end - start) * (s - 1) / (steps - 1) for s in range(1, steps + 1)}
    return LossCurve(losses, end if val is None else val, losses[1])


def test_a_final_validation_loss_worse_than_the_baseline_beyond_the_tolerance_fails_with_both_figures() -> None:
    result = check_quality(_falling(val=3.3), _falling(val=3.0), LIMITS)
    assert result.passed is False
    assert result.measured["rule"] == "baseline"
    assert result.measured["val_loss"] == 3.3 and result.measured["baseline_val_loss"] == 3.0
    assert result.measured["rel_worse"] == pytest.approx(0.1)
    assert "3.3000" in result.message and "3.0000" in result.message and "+10.0%" in result.message
    assert "final validation loss" in result.message and result.look_first


def test_a_run_within_the_tolerance_of_its_baseline_passes() -> None:
    result = check_quality(_falling(val=3.05), _falling(val=3.0), LIMITS)
    assert result.passed is True and result.message == ""
    assert result.measured["rel_worse"] == pytest.approx(0.05 / 3.0)
    assert result.threshold == {"rule": "baseline", "max_rel_worse": 0.02}


def test_a_run_equal_to_its_baseline_passes_and_a_better_one_too() -> None:
    assert check_quality(_falling(), _falling(), LIMITS).passed is True
    assert check_quality(_falling(end=2.5), _falling(), LIMITS).passed is True


def test_a_training_curve_worse_over_the_last_tenth_of_the_steps_fails_even_when_validation_agrees() -> None:
    run = _falling(end=3.5, val=3.0)
    result = check_quality(run, _falling(), LIMITS)
    assert result.passed is False
    assert result.measured["tail_steps"] == [37, 40]
    assert result.measured["tail_rel_worse"] > 0.02
    assert "mean training loss over steps 37-40" in result.message
    assert "final validation loss" not in result.message


def test_without_a_baseline_a_falling_curve_passes_the_sanity_rule() -> None:
    result = check_quality(_falling(start=5.5, val=3.0), None, LIMITS)
    assert result.passed is True
    assert result.measured["rule"] == "sanity" and result.measured["baseline_val_loss"] is None
    assert result.measured["loss_drop_fraction"] == pytest.approx(1 - 3.0 / 5.5)
    assert result.threshold == {"rule": "sanity", "min_loss_drop_fraction": 0.2}


def test_without_a_baseline_a_flat_curve_fails_the_sanity_rule_with_both_figures() -> None:
    result = check_quality(_falling(start=5.5, end=5.3), None, LIMITS)
    assert result.passed is False
    assert "5.3000" in result.message and "5.5000" in result.message
    assert "must fall by at least 20%" in result.message and "no baseline yet" in result.message


@pytest.mark.parametrize("baseline", [None, _falling()])
def test_a_nan_validation_loss_fails_either_rule(baseline: LossCurve | None) -> None:
    assert check_quality(_falling(val=math.nan), baseline, LIMITS).passed is False


def test_the_tail_is_the_last_tenth_of_the_steps_and_at_least_one() -> None:
    assert tail_steps(list(range(1, 41))) == [37, 38, 39, 40]
    assert tail_steps([3, 1, 2]) == [3]


def _correctness(passed: bool = True) -> DimensionResult:
    return DimensionResult(
        name="correctness", passed=passed, measured={"max_rel_deviation": 1e-6, "worst_step": 3},
        threshold={"max_rel_deviation": 1e-3},
    )  # fmt: skip


def test_a_failing_quality_gate_fails_the_correctness_dimension_and_shows_both_rules_figures() -> None:
    quality = check_quality(_falling(val=3.3), _falling(), LIMITS)
    merged = with_quality(_correctness(), quality)
    assert merged.passed is False
    assert merged.measured["max_rel_deviation"] == 1e-6
    assert merged.measured["quality"]["val_loss"] == 3.3 and merged.measured["quality"]["baseline_val_loss"] == 3.0
    assert merged.threshold["quality"] == {"rule": "baseline", "max_rel_worse": 0.02}
    assert merged.message.startswith("quality: final validation loss")


def test_a_passing_gate_keeps_correctness_and_an_unmeasured_one_does_not_fail_it() -> None:
    assert with_quality(_correctness(), check_quality(_falling(), None, LIMITS)).passed is True
    merged = with_quality(_correctness(), not_measured("the run wrote no result"))
    assert merged.passed is True and "quality not measured" in merged.message
    assert with_quality(_correctness(passed=False), check_quality(_falling(), None, LIMITS)).passed is False


def test_the_loss_curve_of_a_run_output_is_rank_0s_losses_and_the_results_validation_loss(tmp_path: Path) -> None:
    writer = RunOutputWriter(str(tmp_path), StorageConfig())
    for step, loss in ((1, 5.5), (2, 5.0), (3, 4.5), (2, 4.9)):  # step 2 ran again after a resume
        writer.append_metrics(StepRecord(step=step, loss=loss))
    writer.append_metrics(StepRecord(rank=1, step=1, loss=9.0))
    writer.close()
    assert loss_curve(tmp_path) is None  # unfinished: no result.json yet
    writer.write_result(RunResult(3, None, 2, 5.5, 4.5, 4.4, math.exp(4.4), 0, 0, 0))
    assert loss_curve(tmp_path) == LossCurve({1: 5.5, 2: 4.9, 3: 4.5}, 4.4, 5.5)


def test_a_fine_tune_is_judged_against_the_starting_models_validation_loss() -> None:
    # Fine-tuning a trained model (model.init_from): its loss barely falls, so the sanity rule's 20% drop would
    # fail it; the bar is the starting model's validation loss, measured before the first step.
    improved = LossCurve({1: 2.0, 2: 1.95, 3: 1.9}, 1.92, 2.0, start_val_loss=2.01)
    result = check_quality(improved, None, LIMITS)
    assert result.passed is True and result.measured["rule"] == "init_from"
    assert result.measured["start_val_loss"] == 2.01 and result.threshold["max_val_loss"] == 2.01
    worse = LossCurve({1: 2.0, 2: 2.4, 3: 2.6}, 2.5, 2.0, start_val_loss=2.01)
    result = check_quality(worse, None, LIMITS)
    assert result.passed is False and "2.5000" in result.message and "2.0100" in result.message
    against_baseline = check_quality(worse, LossCurve({1: 2.0, 2: 2.4, 3: 2.6}, 2.5, 2.0), LIMITS)
    assert against_baseline.passed is False and "starting model's 2.0100" in against_baseline.message


def test_the_loss_curve_carries_the_starting_models_validation_loss_from_the_step_0_evaluation(
    tmp_path: Path,
) -> None:
    writer = RunOutputWriter(str(tmp_path), StorageConfig())
    writer.append_eval({"step": 0, "val_loss": 2.5, "val_ppl": math.exp(2.5)})
    writer.append_metrics(StepRecord(step=1, loss=2.4))
    writer.append_eval({"step": 1, "val_loss": 2.3, "val_ppl": math.exp(2.3)})
    writer.write_result(RunResult(1, None, 2, 2.4, 2.4, 2.3, math.exp(2.3), 0, 0, 0))
    writer.close()
    assert loss_curve(tmp_path) == LossCurve({1: 2.4}, 2.3, 2.4, start_val_loss=2.5)
