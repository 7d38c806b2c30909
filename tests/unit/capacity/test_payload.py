"""Planner and payload agree: `tdeploy plan --emit-parallel` prints a `parallel` section the spec accepts, and every
layout the plan lists as fitting either runs in the payload or says what the payload would reject."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.capacity.payload import parallel_section, payload_problems
from tasks.capacity.plan import CapacityPlan, requested_layout
from tasks.capacity.step import CapacityInputs
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import ParallelConfig
from training.layout import Layout, layout_problems, world_problems

GPU = {
    "kind": "gpu", "peak_tflops_bf16": 100, "peak_tflops_fp16": 100, "peak_tflops_fp32": 10, "hbm_tb_s": 1,
    "intra_node_gb_s": 100, "inter_node_gb_s": 10,
}  # fmt: skip
PATHS = {"data": {"dataset_url": "/d"}, "checkpoint": {"url": "/c"}, "run": {"output_url": "/o"}}
# 8 layers of d512 on 8 GPUs of 1.6 GiB: plain DDP (2.4 GiB) does not fit, sharded and model-parallel layouts do.
BIG: dict[str, Any] = {
    "cluster": {"procs_per_node": 8, "accelerator": "small-gpu"},
    "model": {"n_layers": 8, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "vocab_size": 32000},
    "parallel": {"micro_batch": 8},
    "precision": {"dtype": "bf16"},
    "capacity": {"search_top": 1000, "accelerators": {"small-gpu": {**GPU, "memory_gib": 1.6}}},
}
COMBOS = {
    "dense": {},
    "tied embeddings, vocab not divisible by 2": {"model": {"tie_embeddings": True, "vocab_size": 32001}},
    "moe 8 experts": {
        "model": {"moe": {"n_experts": 8, "top_k": 2}},
        "capacity": {"accelerators": {"small-gpu": {"memory_gib": 2.0}}},
    },  # fmt: skip
    "2 nodes of 4, fp32": {
        "cluster": {"nodes": 2, "procs_per_node": 4, "scheduler": "slurm"},
        "precision": {"dtype": "fp32"},
        "run": {"output_url": "/shared/o"},
    },  # fmt: skip
}


def _data(overrides: dict[str, Any]) -> dict[str, Any]:
    return deep_merge(deep_merge(deep_merge(TINY_SPEC, PATHS), BIG), overrides)


def _spec(overrides: dict[str, Any]) -> DeploymentSpec:
    return parse_spec(_data(overrides))


def _plan(spec: DeploymentSpec) -> CapacityPlan:
    logging.disable(logging.WARNING)  # "communication would dominate" on every tiny case
    try:
        return CapacityInputs.of(spec).estimate()
    finally:
        logging.disable(logging.NOTSET)


def _with_parallel(spec: DeploymentSpec, section: dict[str, Any]) -> DeploymentSpec:
    """The spec with its `parallel` section replaced, parsed again (every spec check runs)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["parallel"] = section
    return parse_spec(data)


def _payload_accepts(spec: DeploymentSpec) -> None:
    c = spec.cluster
    assert layout_problems(spec.model, spec.parallel, spec.precision.dtype) == []
    assert world_problems(spec.parallel, c.world_size, c.procs_per_node, "world") == []


def test_emitted_parallel_section_parses_in_the_spec_and_the_payload_accepts_it(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()  # the CLI's preflight wants the dataset to exist
    data = _data({"data": {"dataset_url": str(tmp_path / "d")}, "capacity": {"output_url": str(tmp_path)}})
    spec = parse_spec(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["plan", str(path), "--emit-parallel"])
    assert result.exit_code == 0, result.output
    emitted = yaml.safe_load(result.stdout)
    assert list(emitted) == ["parallel"]
    assert result.stdout.startswith("# tdeploy plan tiny: fastest fitting layout")
    section = emitted["parallel"]
    best = _plan(spec).search.fitting[0].layout
    assert (section["tensor_parallel"], section["pipeline_parallel"]) == (best.tp, best.pp)
    assert best.tp * best.pp > 1, "the case must pick a model-parallel layout to prove anything"
    spliced = _with_parallel(spec, section)
    _payload_accepts(spliced)
    assert requested_layout(spliced.capacity, spliced.cluster, spliced.parallel) == best
    assert _plan(spliced).fits


@pytest.mark.parametrize("combo", COMBOS.values(), ids=COMBOS.keys())
def test_every_fitting_layout_the_plan_lists_runs_in_the_payload(combo: dict[str, Any]) -> None:
    spec = _spec(combo)
    plan = _plan(spec)
    assert plan.search.fitting, "the case must have fitting layouts"
    assert plan.capacity.search_runnable_only
    for ev in plan.search.fitting:
        assert plan.payload[ev.layout] == [], ev.layout.describe()
        _payload_accepts(_with_parallel(spec, plan.parallel_of(ev).model_dump(mode="json")))


@pytest.mark.parametrize("combo", COMBOS.values(), ids=COMBOS.keys())
def test_with_the_whole_search_a_layout_is_runnable_or_says_what_the_payload_rejects(combo: dict[str, Any]) -> None:
    spec = _spec(deep_merge(combo, {"capacity": {"search_runnable_only": False}}))
    plan = _plan(spec)
    marked = [ev for ev in plan.search.fitting if plan.payload[ev.layout]]
    assert marked, "the whole search lists layouts the payload rejects (ZeRO-1/2 at least)"
    for ev in plan.search.fitting:
        section = plan.parallel_of(ev).model_dump(mode="json")
        # ZeRO-1/2 has no payload equivalent: its section (FSDP, ZeRO-3) runs but is not what was planned.
        rejected = [p for p in plan.payload[ev.layout] if p[0] != ("parallel", "sharding")]
        if rejected:
            with pytest.raises(ValueError):
                _payload_accepts(_with_parallel(spec, section))
        else:
            _payload_accepts(_with_parallel(spec, section))
    reasons = {str(loc) for ev in marked for loc, _, _ in plan.payload[ev.layout]}
    assert "('parallel', 'sharding')" in reasons  # ZeRO-1/2
    json_best = plan.to_json()["search"]["best"]
    assert any(not item["runnable"] and item["payload_problems"] for item in json_best)


def test_moe_plans_never_recommend_tensor_or_pipeline_parallelism() -> None:
    plan = _plan(_spec(COMBOS["moe 8 experts"]))
    assert {(ev.layout.tp, ev.layout.pp) for ev in plan.search.fitting} == {(1, 1)}
    assert any(ev.layout.ep > 1 for ev in plan.search.fitting)


def test_a_rejected_layout_emits_what_to_change() -> None:
    spec = _spec(deep_merge(COMBOS["tied embeddings, vocab not divisible by 2"], {"capacity": {
        "search_runnable_only": False}}))  # fmt: skip
    plan = _plan(spec)
    lo = Layout(dp=2, tp=2, pp=2, micro_batch=8, grad_accum=4)
    problems = payload_problems(lo, spec.model, spec.parallel, "bf16", 1, 8)
    text = "\n".join(f"{loc} {msg}" for loc, _, msg in problems)
    assert "tie_embeddings" in text and "vocab_size" in text and "32002" in text
    plan.payload = {ev.layout: [] for ev in plan.search.fitting} | {plan.search.fitting[0].layout: problems}
    plan.search.fitting = plan.search.fitting[:1]
    out = plan.emit_parallel()
    assert "# NOT RUNNABLE as is; change first:" in out and "model.vocab_size=32001" in out


def test_interleaved_maps_to_the_payloads_interleaved_1f1b_with_its_virtual_stages() -> None:
    base = ParallelConfig(micro_batch=4, ddp_grad_compression="bf16")
    lo = Layout(dp=2, tp=1, pp=2, zero=3, micro_batch=2, grad_accum=4, pp_schedule="interleaved-1f1b", virtual_stages=2)
    par = parallel_section(lo, base)
    assert (par.pipeline_schedule, par.virtual_stages, par.pipeline_parallel) == ("interleaved-1f1b", 2, 2)
    assert (par.sharding, par.micro_batch, par.grad_accum_steps, par.n_microbatches) == ("fsdp", 2, 4, 4)
    assert par.ddp_grad_compression is None
    hsdp = parallel_section(Layout(dp=4, tp=2, zero=3, shard_group=2, micro_batch=1), base)
    assert (hsdp.sharding, hsdp.hsdp_shard_size, hsdp.tensor_parallel) == ("hsdp", 2, 2)


def test_requested_layout_reads_the_payloads_model_parallel_fields() -> None:
    spec = _spec({"parallel": {"tensor_parallel": 2, "pipeline_parallel": 2, "sequence_parallel": True,
        "grad_accum_steps": 4, "pipeline_microbatches": 8}})  # fmt: skip
    lo = requested_layout(spec.capacity, spec.cluster, spec.parallel)
    assert (lo.dp, lo.tp, lo.pp, lo.sequence_parallel) == (2, 2, 2, True)
    assert (lo.micro_batch, lo.grad_accum, lo.global_batch) == (4, 8, 64)  # 8 x 4 sequences in 8 microbatches
