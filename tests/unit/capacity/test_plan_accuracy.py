"""The plan against a run's measurements (validation/plan_accuracy.py), calibration from accepted runs
(tasks/capacity/calibration.py), and activations reported stored and at the peak moment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.capacity import calibration as calib
from tasks.capacity.memory import MemoryModel, Precision
from tasks.capacity.params import Architecture
from tasks.capacity.plan import plan_capacity
from tasks.capacity.step import CapacityInputs
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.layout import Layout
from training.run_output import StepRecord
from validation.plan_accuracy import PlanAccuracy, PlannedFigures, compare_plan, measured_memory, with_history

MIB = 2**20
PLANNED = PlannedFigures(accelerator="h100-sxm", layout="dp2 tp1 pp2", step_seconds=1.0,
                         stage_peak_bytes=[100 * MIB, 60 * MIB])  # fmt: skip


def _metrics(
    step_times: list[float], memory: dict[int, float], runtime: float | None = None
) -> dict[int, dict[int, StepRecord]]:
    """rank -> step -> record, as RunOutput.all_metrics gives them."""
    out: dict[int, dict[int, StepRecord]] = {}
    for rank, peak in memory.items():
        out[rank] = {
            step: StepRecord(
                rank=rank, step=step, loss=3.0, step_time_s=t, peak_mem_bytes=peak, runtime_mem_bytes=runtime
            )
            for step, t in enumerate(step_times, start=1)
        }
    return out


def _accuracy(errors: tuple[float, float], tolerance: float = 0.1) -> PlanAccuracy:
    """A record whose step-time and memory errors are `errors`."""
    step_error, memory_error = errors
    metrics = _metrics([9.0, 1.0 / (1 + step_error)] * 3, {0: 100 * MIB / (1 + memory_error)})
    return compare_plan(PLANNED, metrics, {}, tolerance, warmup_steps=1)


def test_each_rank_is_held_to_its_pipeline_stages_planned_peak_and_rank_0_to_the_step_time() -> None:
    metrics = _metrics([5.0, 1.2, 1.25, 1.3], {0: 110 * MIB, 1: 110 * MIB, 2: 50 * MIB, 3: 50 * MIB})
    accuracy = compare_plan(PLANNED, metrics, {0: 0, 1: 0, 2: 1, 3: 1}, 0.15, warmup_steps=1)
    assert [m.stage for m in accuracy.memory] == [0, 0, 1, 1]
    assert [m.planned_bytes for m in accuracy.memory] == [100 * MIB, 100 * MIB, 60 * MIB, 60 * MIB]
    assert accuracy.measured_step_s == 1.25  # the median after the warm-up step
    assert accuracy.step_time_error == pytest.approx((1.0 - 1.25) / 1.25)
    assert accuracy.worst_memory.rank == 2 and accuracy.memory_error == pytest.approx(0.2)
    assert accuracy.beyond() == ["step_time", "memory"] and not accuracy.within_tolerance
    assert accuracy.ratios() == {"step_time": 1.25, "memory": pytest.approx(50 / 60)}
    data = accuracy.to_json()
    assert data["memory_errors"][0] == pytest.approx(-10 / 110) and data["beyond"] == ["step_time", "memory"]
    assert "step 1 s planned, 1.25 s measured (-20%)" in data["line"] and "on rank 2 (+20%)" in data["line"]


def test_on_cpu_the_runtimes_resident_set_before_the_model_is_taken_off() -> None:
    def record(**memory: int | None) -> StepRecord:
        return StepRecord(step=1, loss=3.0, **memory)

    assert measured_memory(record(peak_mem_bytes=300 * MIB, runtime_mem_bytes=200 * MIB)) == 100 * MIB
    assert measured_memory(record(peak_mem_bytes=300 * MIB, runtime_mem_bytes=None)) == 300 * MIB  # a GPU's
    assert measured_memory(record(peak_mem_bytes=0)) is None and measured_memory(record()) is None
    accuracy = compare_plan(PLANNED, _metrics([1.0, 1.0], {0: 300 * MIB}, runtime=200 * MIB), {}, 0.1, 1)
    assert accuracy.memory[0].measured_bytes == 100 * MIB and accuracy.memory_error == 0.0
    assert accuracy.memory_measure.startswith("peak resident set")


def test_a_run_without_memory_records_is_compared_on_step_time_only() -> None:
    metrics = {0: {s: StepRecord(step=s, loss=3.0, step_time_s=2.0) for s in (1, 2)}}
    accuracy = compare_plan(PLANNED, metrics, {}, 0.1, warmup_steps=5)  # shorter than the warm-up: all but step 1
    assert accuracy.memory == [] and accuracy.measured_step_s == 2.0 and accuracy.beyond() == ["step_time"]


def test_a_planner_finding_needs_the_error_beyond_the_tolerance_on_one_side_in_consecutive_runs() -> None:
    low = _accuracy((-0.5, 0.0))  # the plan says half the measured step time
    assert with_history(low, [], runs=3).finding is None  # one run is not persistent
    assert with_history(low, [_accuracy((-0.4, 0.0))], runs=3).finding is None  # two of three
    found = with_history(low, [_accuracy((-0.4, 0.0)), _accuracy((-0.3, 0.0))], runs=3).finding
    assert found is not None and found.startswith("the plan underestimates step time beyond ±10%")
    assert "(-40%, -30%, -50%)" in found  # oldest first and "peak memory" not in found
    assert with_history(low, [_accuracy((0.4, 0.0)), _accuracy((-0.3, 0.0))], runs=3).finding is None  # sides
    assert with_history(low, [_accuracy((-0.05, 0.0)), _accuracy((-0.3, 0.0))], runs=3).finding is None
    other = _accuracy((-0.4, 0.0)).model_copy(update={"accelerator": "a100-sxm"})
    assert with_history(low, [other, _accuracy((-0.3, 0.0))], runs=3).finding is None  # another accelerator's
    high_memory = with_history(_accuracy((0.0, 0.6)), [_accuracy((0.0, 0.5))], runs=2).finding
    assert high_memory is not None and "overestimates peak memory" in high_memory


def test_calibration_takes_the_median_of_the_newest_runs_and_prefers_them_to_the_file(tmp_path: Path) -> None:
    runs = [_accuracy((e, -e / 2)) for e in (-0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0)]  # ratio 2 x3, then 1 x4
    from_runs = calib.from_runs(runs)
    assert from_runs is not None and from_runs.runs == 5 and from_runs.source == "ledger"
    assert from_runs.step_time_scale == pytest.approx(1.0)  # the newest five: 2, 2, 1, 1, 1
    assert calib.from_runs(runs[:3]).step_time_scale == pytest.approx(2.0)
    assert calib.from_runs([]) is None
    url = tmp_path / "calibration.json"
    url.write_text(json.dumps({"h100-sxm": {"peak_scale": 1.1, "step_time_scale": 1.3, "cases": 4}}))
    from_file = calib.calibration_for(str(url), "h100-sxm", [])
    assert (from_file.memory_scale, from_file.step_time_scale, from_file.source) == (1.1, 1.3, str(url))
    assert calib.calibration_for(str(url), "a100-sxm", []) == calib.NONE
    assert calib.calibration_for(str(url), "h100-sxm", runs[:3]).source == "ledger"
    assert calib.calibration_for(None, "h100-sxm", []) == calib.NONE


def test_a_calibrated_plan_scales_its_compute_and_margin_and_keeps_its_own_figures_for_acceptance() -> None:
    spec = parse_spec(deep_merge(TINY_SPEC, {"cluster": {"accelerator": "h100-sxm"}}))
    args = (spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)
    plain = plan_capacity(*args)
    scaled = plan_capacity(*args, calibration=calib.Calibration(1.5, 2.0, 3, "ledger"))
    raw, time = plain.requested.time, scaled.requested.time
    assert time.matmul == pytest.approx(2 * raw.matmul) and time.memory_bound == pytest.approx(2 * raw.memory_bound)
    assert scaled.requested.memory.margin > plain.requested.memory.margin
    assert scaled.planned() == plain.planned() == CapacityInputs.of(spec).planned()
    data = scaled.to_json()["calibration"]
    assert data["step_time_scale"] == 2.0 and data["uncalibrated"]["step_seconds"] == plain.requested.step_seconds
    from tasks.capacity.report import markdown_report

    assert "calibrated from the ledger (3 runs): step time x2" in markdown_report(scaled)


def test_stored_activations_count_every_micro_batch_in_flight_and_the_peak_moment_fewer() -> None:
    arch = Architecture(n_layers=8, d_model=256, n_heads=8, ffn_hidden=768, vocab_size=1000, seq_len=128)
    model = MemoryModel(arch, Precision.of("bf16", "master-weights"))
    lo = Layout(dp=1, pp=4, micro_batch=2, grad_accum=8)
    first = model.stage(lo, "first")
    per_layer = model._act_bytes("none", 2, 1, False)
    assert first.activations_stored == pytest.approx(4 * 2 * per_layer)  # 4 micro-batches x 2 layers (1F1B)
    assert first.activations <= first.activations_stored  # the peak moment frees what a block's backward ends
    data = first.as_dict()
    assert data["activations_stored_bytes"] == first.activations_stored
    assert data["activations_bytes"] == first.activations
