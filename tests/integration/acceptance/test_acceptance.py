"""The acceptance suite and the drills on CPU with gloo, 2 ranks, the tiny model, through the local launcher.

The suite must pass a clean run and fail each dimension when a test-only fault breaks it.
Scaling and communication thresholds here are loose on purpose (no timing thresholds in tests): two ranks
share two cores with everything else in CI. The straggler rule keeps its default (1.25x the other ranks'
compute, step by step): the slow-rank fault makes rank 1 1.5x slower than its own recent steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.acceptance.drills import DrillContext, drill_rank_kill, run_drills
from tasks.acceptance.report import plot_losses, write_json, write_junit
from tasks.acceptance.suite import judge, run_acceptance, run_correctness_pair
from tasks.acceptance.workspace import Job, variant
from training.faults import ENV_VAR

pytestmark = pytest.mark.integration

LOOSE = {"scaling_efficiency_min": 0.01, "comm_share_max": 1.0, "correctness_max_rel_deviation": 1e-4}


def _acceptance(**overrides) -> AcceptanceConfig:  # noqa: ANN003
    return AcceptanceConfig.model_validate({"thresholds": LOOSE, "steps": 40, "save_every_steps": 10, **overrides})


def _faulty_judgement(make_spec, tmp_path: Path, faults: dict, acceptance: AcceptanceConfig | None = None) -> dict:
    """A distributed run with `faults` and the independent reference, judged; returns dimension name -> result."""
    acceptance = acceptance or _acceptance()
    spec = make_spec()
    train = spec.training_config()
    injected = {ENV_VAR: json.dumps(faults)}
    dist_train = variant(train, tmp_path, "dist", run={"steps": acceptance.steps})
    dist = Job(spec.cluster, dist_train, "dist", injected, None).wait(600, acceptance.thresholds.stall_timeout_s)
    pair, reference = run_correctness_pair(spec.cluster, train, acceptance, tmp_path, acceptance.steps, injected)
    return {d.name: d for d in judge(spec.cluster, dist_train, acceptance, dist, reference, pair)}


def test_three_clean_runs_in_a_row_pass_every_dimension_and_write_the_reports(make_spec, tmp_path: Path) -> None:
    # what users turn on: dropout (RNG restore) and accumulation (the reference takes the batch in one pass)
    spec = make_spec({"model": {"dropout": 0.1}, "parallel": {"micro_batch": 2, "grad_accum_steps": 2}})
    deviations, quality = [], []
    for attempt in range(3):  # no false alarms; the first run records the baseline the others are held to
        root = tmp_path / f"attempt-{attempt}"
        report = run_acceptance(spec.cluster, spec.training_config(), _acceptance(steps=60), root)
        verdicts = {d.name: (d.passed, d.message) for d in report.dimensions}
        assert all(passed for passed, _ in verdicts.values()), (attempt, verdicts)
        assert set(verdicts) == {"connectivity", "correctness", "performance", "stability", "data_consistency",
                                 "recovery"}  # fmt: skip
        (kill,) = report.drills
        assert kill.name == "rank_kill" and kill.passed and kill.state_matched and kill.recovery_s > 0
        perf = next(d for d in report.dimensions if d.name == "performance")
        assert 0 < perf.measured["scaling_efficiency"] and perf.measured["slow_rank"] is None
        correctness = next(d for d in report.dimensions if d.name == "correctness")
        deviations.append(correctness.measured["max_rel_deviation"])
        quality.append(correctness.measured["quality"]["rule"])
        assert "correctness" in report.runs  # dropout on: the comparison ran a distributed job of its own
    print(f"clean deviations from the independent reference: {deviations}")
    tolerance = AcceptanceConfig().thresholds.correctness_max_rel_deviation
    assert max(deviations) < tolerance / 10
    assert quality == ["sanity", "baseline", "baseline"]

    data = json.loads(write_json(report, tmp_path / "acceptance.json").read_text())
    assert data["verdict"] == "passed" and len(data["dimensions"]) == 6
    suite = ET.parse(write_junit(report, tmp_path / "junit.xml")).getroot()
    assert suite.get("tests") == "7" and suite.get("failures") == "0"
    assert plot_losses(report, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_two_ranks_fed_the_same_samples_fail_data_consistency(make_spec, tmp_path: Path) -> None:
    dims = _faulty_judgement(make_spec, tmp_path, {"same_samples_as_rank0": 1})
    assert not dims["data_consistency"].passed
    assert "ranks 0 and 1 share" in dims["data_consistency"].message
    assert dims["connectivity"].passed and dims["stability"].passed


def test_a_rank_seeded_differently_fails_correctness(make_spec, tmp_path: Path) -> None:
    dims = _faulty_judgement(make_spec, tmp_path, {"seed_offset_rank": 1, "seed_offset": 99})
    assert not dims["correctness"].passed
    assert dims["correctness"].measured["max_rel_deviation"] > 1e-4
    assert "data order and seeds per rank" in dims["correctness"].look_first


def test_a_slow_rank_fails_performance_and_is_named(make_spec, tmp_path: Path) -> None:
    """Rank 1 computes 1.5x as long as it would (relative, not a fixed sleep): above the default 1.25x."""
    dims = _faulty_judgement(make_spec, tmp_path, {"slow_rank": 1, "slow_factor": 1.5})
    perf = dims["performance"]
    assert perf.threshold["straggler_ratio_max"] == 1.25
    assert not perf.passed and perf.measured["slow_rank"] == 1, perf.measured
    assert perf.measured["straggler_ratio_per_rank"][1] > 1.25
    assert "rank 1 computes" in perf.message and "rank 1's host" in perf.look_first


def test_nan_at_step_k_fails_stability_at_step_k(make_spec, tmp_path: Path) -> None:
    dims = _faulty_judgement(make_spec, tmp_path, {"nan_at_step": 7})
    assert not dims["stability"].passed
    assert dims["stability"].measured["first_bad_step"] == 7 and "loss is nan at step 7" in dims["stability"].message


def test_a_hang_is_caught_by_the_stall_watchdog(make_spec, tmp_path: Path) -> None:
    acceptance = _acceptance(thresholds={**LOOSE, "stall_timeout_s": 5})
    dims = _faulty_judgement(make_spec, tmp_path, {"pause_after_step": 12}, acceptance)
    stability = dims["stability"]
    assert not stability.passed and stability.measured["first_bad_step"] == 12
    assert "no progress for 5s after step 12 (a hang)" in stability.message


def test_a_checkpoint_without_optimizer_state_fails_recovery(make_spec, tmp_path: Path) -> None:
    spec = make_spec()
    # killed after the first save (step 20), resumed with fresh optimizer moments: step 21 already differs
    acceptance = _acceptance(steps=60, save_every_steps=20)
    faults = {ENV_VAR: json.dumps({"checkpoint_without_optimizer": True})}
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance, faults=faults)
    result, recovery = drill_rank_kill(ctx)
    assert not recovery.passed and not result.passed
    assert "differs from the uninterrupted run" in recovery.message


def test_every_drill_recovers_with_state_matching(make_spec, tmp_path: Path) -> None:
    spec = make_spec()
    # kill_during_save at one phase here: test_save_drills.py kills at every phase
    drills = DrillConfig(save_phases=["after_extras"])
    acceptance = _acceptance(steps=200, save_every_steps=20)
    ctx = DrillContext(spec.cluster, spec.training_config(), tmp_path, acceptance, drills)
    results = {r.name: r for r in run_drills(ctx)}
    assert set(results) == {"rank_kill", "kill_during_save", "corrupt_checkpoint", "reshard", "storage_outage"}
    for name, result in results.items():
        assert result.passed, (name, result.message, result.evidence)
        assert result.state_matched, name
    save_phases = {p["phase"]: p for p in results["kill_during_save"].evidence["phases"]}
    assert list(save_phases) == ["after_extras"]
    phase = save_phases["after_extras"]
    assert phase["whole"] and phase["resumed_from"] == phase["expected_step"] == 20, phase
    assert phase["partial_skipped_with_warning"], phase
    assert results["corrupt_checkpoint"].evidence["detected_and_skipped"]
    assert results["reshard"].evidence["to_world_size"] == 1
    assert results["storage_outage"].evidence["failed_save_step"] > 20
    assert all(r.recovery_s is not None and r.recovery_s >= 0 for r in results.values())
