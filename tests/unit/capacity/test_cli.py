"""`tdeploy plan SPEC [--json]`: plan.json with units, a table, and a non-zero exit when the layout does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.capacity.plan import plan_capacity
from tasks.capacity.record import read_plan
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge

# A model large enough that where it fits depends on the layout.
BIG = {
    "cluster": {"procs_per_node": 8, "accelerator": "small-gpu"},
    "model": {"n_layers": 8, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "vocab_size": 32000},
    "parallel": {"micro_batch": 8},
    "precision": {"dtype": "bf16"},
}
SMALL_GPU = {
    "kind": "gpu", "peak_tflops_bf16": 100, "peak_tflops_fp16": 100, "peak_tflops_fp32": 10, "hbm_tb_s": 1,
    "intra_node_gb_s": 100, "inter_node_gb_s": 10,
}  # fmt: skip


def _write_spec(tmp_path: Path, overrides: dict) -> Path:
    (tmp_path / "d").mkdir(exist_ok=True)  # every command's preflight wants the dataset to exist
    paths = {
        "data": {"dataset_url": str(tmp_path / "d")},
        "checkpoint": {"url": str(tmp_path / "c")},
        "run": {"output_url": str(tmp_path / "o")},
        "capacity": {"output_url": str(tmp_path / "plan")},
    }
    data = deep_merge(deep_merge(TINY_SPEC, paths), overrides)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_prints_a_table_and_writes_plan_json_with_units(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(_write_spec(tmp_path, {}))])
    assert result.exit_code == 0, result.output
    assert "memory of the requested layout" in result.output and "layouts that fit" in result.output
    plan = read_plan(str(tmp_path / "plan" / "plan.json"))
    assert plan.fits is True
    memory = plan.requested.memory
    assert memory["total_bytes"] >= memory["allocated_peak_bytes"] > memory["weights_bytes"] > 0
    assert plan.raw["model"]["params"] > 0 and plan.raw["training"]["days"] > 0
    assert plan.raw["requested"]["communication"]["bytes_per_gpu"]["data_parallel"] > 0
    assert plan.search.evaluated_layouts >= len(plan.search.best) > 0
    assert all(item.why for item in plan.search.best)


def test_plan_json_goes_to_stdout(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(_write_spec(tmp_path, {})), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["requested"]["layout"]["name"] == "dp2 tp1 pp1 zero0 mb4x1 none"


def test_a_layout_that_does_not_fit_exits_1_with_needed_available_and_fitting_layouts(tmp_path: Path) -> None:
    # Size the device between what the requested DDP layout needs and what the best alternative needs.
    roomy = deep_merge(BIG, {"capacity": {"accelerators": {"small-gpu": {**SMALL_GPU, "memory_gib": 1000}}}})
    spec = parse_spec(
        deep_merge(
            TINY_SPEC,
            {"data": {"dataset_url": "/d"}, "checkpoint": {"url": "/c"}, "run": {"output_url": "/o"}, **roomy},
        )
    )
    probe = plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)
    needed = probe.requested.memory.total
    smallest = min(e.memory.total for e in probe.search.fitting)
    assert smallest < needed
    memory_gib = (needed + smallest) / 2 / 0.9 / 2**30
    tight = deep_merge(BIG, {"capacity": {"accelerators": {"small-gpu": {**SMALL_GPU, "memory_gib": memory_gib}}}})
    result = CliRunner().invoke(app, ["plan", str(_write_spec(tmp_path, tight))])
    assert result.exit_code == 1
    assert "layout dp8 tp1 pp1 zero0 mb8x1 none does not fit: needs" in result.output
    assert "GiB usable" in result.output and "layouts that fit, fastest first:" in result.output
    assert not read_plan(str(tmp_path / "plan" / "plan.json")).fits


def test_self_check_measures_the_specs_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(_write_spec(tmp_path, {})), "--self-check"])
    assert result.exit_code == 0, result.output
    check = read_plan(str(tmp_path / "plan" / "plan.json")).self_check[0]
    assert abs(check["error_fraction"]) < 0.02 and "self-check" in result.output
