"""The self-check of a model-parallel spec runs a tiny model in the spec's layout shape under the real trainer
(torchrun, gloo) and sets each dimension's measured bytes per step beside the planner's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.layout_check import run_parallel_self_check, tiny_layout
from tasks.capacity.report import format_self_check
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _spec(overrides: dict) -> object:
    paths = {"data": {"dataset_url": "/d"}, "checkpoint": {"url": "/c"}, "run": {"output_url": "/o"}}
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, paths), overrides))


def test_tiny_layout_keeps_the_shape_within_four_processes() -> None:
    spec = _spec({"cluster": {"procs_per_node": 8}, "model": {"n_layers": 8, "vocab_size": 260, "n_kv_heads": 4},
                  "parallel": {"tensor_parallel": 4, "pipeline_parallel": 2, "grad_accum_steps": 2,
                               "sequence_parallel": True}})  # fmt: skip
    model, par, procs = tiny_layout(spec.model, spec.parallel)
    assert (par["tensor_parallel"], par["pipeline_parallel"], par["sequence_parallel"], procs) == (2, 2, True, 4)
    assert model["n_layers"] % par["pipeline_parallel"] == 0


def test_expert_parallel_self_check_measures_all_to_all_and_gradient_bytes_near_the_plan(tmp_path: Path) -> None:
    spec = _spec({"model": {"vocab_size": 258, "moe": {"n_experts": 8, "top_k": 2}}, "parallel": {
        "expert_parallel": 2, "grad_accum_steps": 2}})  # fmt: skip
    check = run_parallel_self_check(spec.model, spec.parallel, spec.precision, spec.cluster, work=tmp_path)
    assert check["kind"] == "traffic" and "ep2" in check["layout"]
    ep = check["dims"]["ep"]
    assert ep["measured_bytes_per_step"] > 0
    # Routing decides the all-to-all's size: near the even share the planner assumes, not equal to it.
    assert 0.7 < ep["ratio"] < 1.3, check
    assert 0.95 < check["dims"]["dp"]["ratio"] < 1.05, check
    assert check["measured_param_bytes"] == pytest.approx(check["predicted_param_bytes"], rel=0.05)
    assert "ep  measured" in format_self_check(check)
