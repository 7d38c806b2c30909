"""One layout model (training/layout.py): the payload's `parallel` section and the planner's `capacity.layout` are
checked by one validator in the same words, name the same settings the same way, and print through one class."""

from __future__ import annotations

import pytest

from tasks.capacity.plan import requested_layout
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import ParallelConfig
from training.layout import PLANNED_ONLY, Layout

BASE = deep_merge(
    TINY_SPEC,
    {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}},
)
FOUR = {"cluster": {"procs_per_node": 4}}


def _problems(overrides: dict) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(deep_merge(BASE, overrides))
    return err.value.problems


@pytest.mark.parametrize(
    ("cluster", "layout"),
    [
        (FOUR, {"tensor_parallel": 4}),  # 4 heads but 2 KV heads
        ({}, {"sequence_parallel": True}),  # without tensor parallelism
        ({}, {"expert_parallel": 2}),  # a dense model
        (FOUR, {"pipeline_parallel": 2, "pipeline_schedule": "interleaved-1f1b"}),  # no virtual stages
        (FOUR, {"pipeline_parallel": 2, "pipeline_split": [1, 2]}),  # 3 layers for a 2-layer model
        ({}, {"tensor_parallel": 2, "pipeline_parallel": 2}),  # 4 ranks on 2 processes
        ({"cluster": {"procs_per_node": 3}}, {"tensor_parallel": 2}),  # 2 does not divide 3 processes
    ],
)
def test_a_layout_gets_the_same_messages_in_parallel_and_in_capacity_layout(cluster: dict, layout: dict) -> None:
    payload = _problems(deep_merge(cluster, {"parallel": layout}))
    planned = _problems(deep_merge(cluster, {"capacity": {"layout": layout}}))
    assert planned and all(p.startswith("capacity.layout.") for p in planned), planned
    assert {p.replace("capacity.layout.", "parallel.", 1) for p in planned} <= set(payload), (planned, payload)


def test_the_planned_only_table_is_what_the_payload_rejects_and_the_planner_plans() -> None:
    assert set(PLANNED_ONLY) == {"context_parallel"}
    [problem] = _problems({"parallel": {"context_parallel": 2}})
    assert problem == f"parallel.context_parallel=2: {PLANNED_ONLY['context_parallel']}"
    spec = parse_spec(deep_merge(BASE, {**FOUR, "capacity": {"layout": {"context_parallel": 2}}}))
    layout = requested_layout(spec.capacity, spec.cluster, spec.parallel)
    assert (layout.cp, layout.dp) == (2, 2)


def test_the_planners_override_names_the_schedule_as_parallel_does() -> None:
    inter = {"pipeline_parallel": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved-1f1b"}
    spec = parse_spec(deep_merge(BASE, {"model": {"n_layers": 4}, "capacity": {"layout": inter}}))
    layout = requested_layout(spec.capacity, spec.cluster, spec.parallel)
    assert (layout.pp_schedule, layout.chunks) == ("interleaved-1f1b", 4)
    [problem] = _problems({"capacity": {"layout": {**inter, "pipeline_schedule": "interleaved"}}})
    assert problem == (
        "capacity.layout.pipeline_schedule=interleaved: interleaved is named interleaved-1f1b now, as in "
        "parallel.pipeline_schedule; set capacity.layout.pipeline_schedule: interleaved-1f1b"
    )


def test_one_layout_prints_its_mesh_and_its_whole_plan() -> None:
    par = ParallelConfig(
        micro_batch=2, grad_accum_steps=4, tensor_parallel=2, pipeline_parallel=2, sharding="fsdp",
        sequence_parallel=True, pipeline_schedule="interleaved-1f1b", virtual_stages=2,
    )  # fmt: skip
    layout = Layout.of(par, world=8, procs_per_node=4)
    assert (layout.dp, layout.zero, layout.micro_batch, layout.grad_accum) == (2, 3, 2, 4)
    assert layout.degrees("sp") == "pp2 x dp2 x tp2 (fsdp, sp)"
    assert layout.describe() == "dp2 tp2 pp2 zero3 mb2x4 none sp v2"
    hsdp = Layout.of(ParallelConfig(micro_batch=1, sharding="hsdp"), world=8, procs_per_node=4)
    assert (hsdp.shard, hsdp.degrees()) == (4, "dp8 (hsdp)")
