"""What people read in the Prefect UI and what programs read in summary.json: figures with their units and
scales in the tables (never JSON cut at the edge), numbers as numbers in the file."""

from __future__ import annotations

import json
from pathlib import Path

from tasks import tables
from tasks.acceptance.record import AcceptanceReport, DrillResult
from tasks.acceptance.report import table_rows
from tasks.capacity.step import CapacityResult
from tasks.pipeline import SUMMARY_JSON, RunSummary, summarize
from tasks.serve.chain import ParityChain
from tasks.serve.check import ServingReport
from tasks.serve.report import table_rows as serving_rows
from tasks.serve.step import ServingResult
from validation.acceptance import DimensionResult, PerformanceFigures
from validation.serving import (
    LatencyFigures,
    LoadFigures,
    LogprobFigures,
    ParityFigures,
    QualityFigures,
    ServerFigures,
    ServingThresholds,
    judge,
)

PERFORMANCE = DimensionResult(
    name="performance",
    passed=True,
    figures=PerformanceFigures(scaling_efficiency=0.83, tokens_per_s=12345.6, comm_share=0.12, layout="dp4 (ddp)"),
    measured={
        "comm_share_per_rank": {"0": 0.1, "1": 0.12, "2": 0.11, "3": 0.09},
        "compute_s_per_rank": {"0": 0.5, "1": 0.52, "2": 0.49, "3": 0.51},
        "resources": {"cpu": {"per_rank": [0.9, 0.8]}, "memory": {"peak_bytes": 2**31}},
        "straggler_basis": "cpu",
    },
    threshold={"scaling_efficiency_min": 0.7, "comm_share_max": 0.5, "straggler_ratio_max": 1.25},
)


def _serving_report() -> ServingReport:
    lat = LatencyFigures(p50=20.0, p95=36.0, p99=40.0, mean=20.0)
    load = LoadFigures(32, 0, 2.0, 512, 300.0, 16.0, lat, lat, lat, 4, None)
    quality = QualityFigures(16, 0.412, 23.4)
    thresholds = ServingThresholds(rouge_l_min=0.1, bleu4_min=5.0)
    checks = judge(load, ParityFigures(4, 8, 4), quality, thresholds)
    return ServingReport(
        "m", 6, "http://x", 1, "cpu", 1, load, ServerFigures(3, 0.1, 4.0, 0.0, 3.5, 0.0), ParityFigures(4, 8, 4),
        LogprobFigures(4, 28, 1e-5, 1e-6), quality, checks, ParityChain([]), [1.0], {"json": "serving.json"},
    )  # fmt: skip


def test_the_acceptance_table_shows_measured_figures_with_units_beside_thresholds_in_the_same_unit() -> None:
    report = AcceptanceReport(
        dimensions=[PERFORMANCE], drills=[DrillResult("rank_kill", True, recovery_s=2.5, steps_lost=3)]
    )
    row, drill = table_rows(report)
    for cell in (row["measured"], row["threshold"], drill["measured"]):
        assert "{" not in cell and '"' not in cell, cell  # no JSON, cut or whole
    assert "tokens_per_s=12,346 tokens/s" in row["measured"] and "scaling_efficiency=83%" in row["measured"]
    assert "comm_share_per_rank=4 values, max 12%" in row["measured"]
    assert "scaling_efficiency ≥ 70%" in row["threshold"] and "comm_share ≤ 50%" in row["threshold"]
    assert "straggler_ratio ≤ 1.25x" in row["threshold"]
    assert drill["measured"] == "recovery_s=2.5 s; steps_lost=3"  # a figure not measured (None) is left out


def test_a_long_measurement_is_cut_by_figures_counted_not_by_characters() -> None:
    measured = {f"figure_{n}_ms": float(n) for n in range(20)}
    text = tables.text(measured)
    assert text.endswith("; +12 more") and "figure_7_ms=7 ms" in text and "figure_8_ms" not in text


def test_bleu_and_rouge_l_are_labelled_with_their_scales_in_the_serving_table_and_summaries() -> None:
    report = _serving_report()
    rows = {row["check"]: row for row in serving_rows(report)}
    assert rows["ROUGE-L F1"]["measured"] == "0.412 (0-1)" and rows["ROUGE-L F1"]["threshold"] == "0.1 (0-1)"
    assert rows["BLEU-4"]["measured"] == "23.4 (0-100)" and rows["BLEU-4"]["threshold"] == "5 (0-100)"
    assert rows["p99_e2e_latency_ms"]["measured"] == "40 ms" and rows["error_rate"]["measured"] == "0%"
    result = ServingResult.of(report)
    assert "ROUGE-L F1 0.412 (0-1), BLEU-4 23.40 (0-100)" in result.summary()
    row = summarize("x", {"serving": result}, None, None, None).steps[-1]
    assert "ROUGE-L F1=0.412 (0-1)" in row.text() and "BLEU-4=23.4 (0-100)" in row.text()


def test_summary_json_holds_the_figures_as_numbers_with_units_in_their_names(tmp_path: Path) -> None:
    capacity = CapacityResult(plan_url="runs/x/plan.json", fits=True, layout="dp2", peak_bytes=3 * 2**30,
                              usable_bytes=14 * 2**30, step_seconds=0.25)  # fmt: skip
    results = {"capacity": capacity, "serving": ServingResult.of(_serving_report())}
    summarize("x", results, None, None, None).write(tmp_path)
    steps = {row["step"]: row for row in json.loads((tmp_path / SUMMARY_JSON).read_text())["steps"]}
    assert steps["capacity"]["figures"]["peak_bytes"] == 3 * 2**30 and steps["capacity"]["figures"]["step_s"] == 0.25
    serving = steps["serving"]["figures"]
    assert serving["p99_e2e_ms"] == 40.0 and serving["output_tokens_per_s"] == 300.0
    assert serving["rouge_l"] == 0.412 and serving["bleu4"] == 23.4 and serving["error_rate"] == 0.0
    assert "peak_bytes=3 GiB" in (tmp_path / "summary.md").read_text()


def test_a_summary_json_from_before_the_figures_were_numbers_still_reads(tmp_path: Path) -> None:
    old = {"name": "x", "failed_step": None, "error": None, "diagnosis": None,
           "steps": [{"step": "capacity", "title": "capacity estimation", "verdict": "passed",
                      "figures": "fits: True; peak 3.00 GiB of 14.00 GiB usable per device",
                      "details": "-"}]}  # fmt: skip
    (tmp_path / SUMMARY_JSON).write_text(json.dumps(old))
    row = RunSummary.read(tmp_path).steps[0]
    assert row.figures == {} and row.note == old["steps"][0]["figures"] and row.text() == row.note
