"""The plan names its FLOPs conventions, reports MFU and HFU, and turns a FLOP budget into time and a
compute-optimal model size (the issue's "each convention named in the output")."""

from __future__ import annotations

import pytest

from tasks.capacity.compute import flops_per_token
from tasks.capacity.report import markdown_report
from tasks.capacity.scaling import CHINCHILLA_FIT
from tasks.capacity.step import CapacityInputs
from tasks.spec import parse_spec
from tests.conftest import deep_merge
from tests.unit.capacity.test_memory import ZERO_PAPER_SPEC


def _plan(capacity: dict):  # noqa: ANN202
    spec = parse_spec(deep_merge(ZERO_PAPER_SPEC, {"capacity": capacity, "parallel": {"activation_recompute":
                                                                                       "selective"}}))  # fmt: skip
    return CapacityInputs.of(spec).estimate()


def test_the_plan_names_each_flops_convention_and_reports_mfu_and_hfu() -> None:
    plan = _plan({})
    data = plan.to_json()["flops"]
    names = [c["name"] for c in data["conventions"]]
    assert names == ["6ND, all parameters", "6ND, non-embedding parameters", "model FLOPs", "hardware FLOPs"]
    by_key = {c["key"]: c for c in data["conventions"]}
    per_token = flops_per_token(plan.arch, "selective")
    assert by_key["hardware"]["per_token_flops"] == pytest.approx(per_token.hardware)
    assert by_key["six_nd"]["training_flops"] == pytest.approx(6 * 7_499_681_792 * plan.train_tokens)
    assert data["hfu"] / data["mfu"] == pytest.approx(per_token.hardware / per_token.model)
    assert data["hfu"] > data["mfu"]  # selective recompute does more arithmetic than the model needs
    text = markdown_report(plan)
    assert "FLOPs per token: 6ND, all parameters " in text and "hardware FLOPs " in text
    assert "HFU " in text and plan.to_json()["flop_budget"] is None


def test_a_flop_budget_gives_its_time_here_and_the_compute_optimal_size() -> None:
    plan = _plan({"flop_budget": 5.76e23})  # Chinchilla's own budget
    budget = plan.to_json()["flop_budget"]
    ev = plan.requested
    peak = plan.accelerator.peak_flops(plan.precision.compute_dtype)
    assert budget["seconds"] == pytest.approx(5.76e23 / (ev.layout.world * peak * ev.mfu))
    rule = budget["compute_optimal"]["twenty_tokens_per_param"]
    assert rule["params"] == pytest.approx(69.3e9, rel=0.01) and rule["tokens"] == pytest.approx(20 * rule["params"])
    fit = budget["compute_optimal"]["approach_3_fit"]
    assert fit["params"] == pytest.approx(CHINCHILLA_FIT.optimal(5.76e23).params)
    assert "budget 5.76e+23 FLOPs (6ND)" in markdown_report(plan) and "20 tokens per parameter" in markdown_report(plan)
