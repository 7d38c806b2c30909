"""Uneven pipeline stages: any split of the layers over the stages, the embedding on the first and the output layer
on the last, memory per stage with the peak stage named, and the same split in the `parallel` section the payload
runs (Llama 3 405B: 126 layers on 16 stages)."""

from __future__ import annotations

import itertools

import pytest

from tasks.capacity.memory import MemoryModel, Precision, candidate_stages, micro_batches_in_flight
from tasks.capacity.params import PRESETS, Architecture, count_params
from tasks.capacity.payload import parallel_section
from tasks.capacity.plan import CapacityPlan, plan_capacity
from tasks.capacity.search import enumerate_layouts
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import ParallelConfig
from training.layout import Layout

MIXED = Precision.of("bf16", "master-weights")
LLAMA_405B = PRESETS["llama-3.1-405b"]
SMALL = Architecture(n_layers=10, d_model=256, n_heads=8, ffn_hidden=768, vocab_size=1000, seq_len=128)

# Llama 3 405B's training layout (Llama Team 2024, "The Llama 3 Herd of Models", Table 4, first row): 8,192 GPUs,
# TP 8, CP 1, PP 16, DP 64, sequence 8,192, 32 sequences per data-parallel rank (16M tokens a batch).
LLAMA_405B_SPEC = deep_merge(
    TINY_SPEC,
    {
        "cluster": {"scheduler": "slurm", "nodes": 1024, "procs_per_node": 8, "accelerator": "h100-sxm"},
        "model": {"n_layers": 126, "d_model": 16384, "n_heads": 128, "n_kv_heads": 8, "ffn_hidden": 53248,
                  "vocab_size": 128256, "seq_len": 8192},
        "parallel": {"micro_batch": 1, "grad_accum_steps": 32},
        "precision": {"dtype": "bf16"},
        "capacity": {"layout": {"tensor_parallel": 8, "pipeline_parallel": 16, "zero_stage": 1,
                                "sequence_parallel": True}, "global_batch": 2048, "search_top": 1},
        "data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"},
    },
)  # fmt: skip


def _plan(raw: dict) -> CapacityPlan:
    spec = parse_spec(raw)
    return plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)


def test_126_layers_on_16_stages_are_planned_with_the_balanced_split_and_the_peak_stage_named() -> None:
    plan = _plan(LLAMA_405B_SPEC)
    lo = plan.requested.layout
    assert (lo.tp, lo.pp, lo.dp, lo.grad_accum) == (8, 16, 64, 32)
    assert list(lo.stage_layers(126)) == [7, 7] + [8] * 14  # the payload's balanced_split: the extra layers last
    stages = plan.to_json()["requested"]["stages"]
    assert [s["layers"] for s in stages] == list(lo.stage_layers(126))
    peak = max(stages, key=lambda s: s["total_bytes"])
    assert plan.requested.memory.stage == peak["stage"] and plan.requested.memory.total == peak["total_bytes"]


def test_a_given_split_is_planned_and_reaches_the_parallel_section_the_payload_runs() -> None:
    spec = deep_merge(LLAMA_405B_SPEC, {"capacity": {"layout": {"pipeline_split": [6] + [8] * 14 + [8]}}})
    with pytest.raises(SpecError) as err:  # 16 numbers, but summing to 96
        parse_spec(deep_merge(spec, {"capacity": {"layout": {"pipeline_split": [6] * 16}}}))
    (problem,) = err.value.problems
    assert problem.startswith("capacity.layout.pipeline_split=[6, 6, ")
    assert "must list 16 chunk sizes" in problem and "summing to model.n_layers=126" in problem
    split = [6, 7] + [8] * 13 + [9]
    plan = _plan(deep_merge(spec, {"capacity": {"layout": {"pipeline_split": split}}}))
    assert list(plan.requested.layout.stage_layers(126)) == split
    assert "split 6-7-8" in plan.requested.layout.describe()
    section = parallel_section(plan.requested.layout, ParallelConfig(micro_batch=1))
    assert section.pipeline_split == split and section.pipeline_parallel == 16


def test_the_old_even_stage_rule_no_longer_refuses_126_layers_on_16_stages() -> None:
    plan = _plan(LLAMA_405B_SPEC)
    assert plan.requested.layout.pp == 16  # before: "pipeline chunks 16 must divide model.n_layers=126"


@pytest.mark.parametrize("split", [(1, 2, 3, 4), (4, 3, 2, 1), (1, 4, 4, 1), (2, 3, 3, 2), (3, 1, 1, 5)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_peak_is_the_largest_stage_of_every_split(split: tuple[int, ...], schedule: str) -> None:
    model = MemoryModel(SMALL, MIXED)
    lo = Layout(dp=1, pp=4, micro_batch=2, grad_accum=8, split=split, pp_schedule=schedule)  # type: ignore[arg-type]
    stages = model.stages(lo)
    assert [s.stage_layers for s in stages] == list(split)
    assert [s.stage for s in stages] == ["first", "stage 1", "stage 2", "last"]
    assert model.estimate(lo).total == max(s.total for s in stages)


def test_stages_hold_the_embedding_first_and_the_output_layer_last() -> None:
    model = MemoryModel(SMALL, MIXED)
    pc = count_params(SMALL)
    lo = Layout(dp=1, pp=3, micro_batch=1, grad_accum=4, split=(3, 4, 3))
    first, middle, last = (s.states.optimizer_params for s in model.stages(lo))
    assert first == pytest.approx(3 * pc.per_layer + pc.embedding)
    assert middle == pytest.approx(4 * pc.per_layer)
    assert last == pytest.approx(3 * pc.per_layer + (pc.head or pc.embedding) + pc.final_norm)


def test_a_middle_stage_with_more_layers_can_be_the_peak() -> None:
    model = MemoryModel(SMALL, MIXED)
    lo = Layout(dp=1, pp=4, micro_batch=4, grad_accum=8, split=(1, 7, 1, 1), recompute="none")
    peak = model.estimate(lo)
    assert peak.stage == "stage 1" and peak.stage_layers == 7  # never looked at before: first or last only


def test_micro_batches_in_flight_follow_1f1b_and_the_interleaved_warm_up() -> None:
    one_f_one_b = Layout(dp=1, pp=4, grad_accum=8)
    assert [micro_batches_in_flight(one_f_one_b, i) for i in range(4)] == [4, 3, 2, 1]
    inter = Layout(dp=1, pp=4, grad_accum=8, pp_schedule="interleaved-1f1b", virtual_stages=2)
    # The first stage: Korthikanti et al. 2022, section 4.2.3, p(1 + (p-1)/(pv)) = 4 x 11/8.
    assert micro_batches_in_flight(inter, 0) == pytest.approx(4 * (1 + 3 / 8))
    assert micro_batches_in_flight(inter, 3) == pytest.approx((4 + 1) / 2)  # (v-1)p warm-up chunks plus one
    assert micro_batches_in_flight(Layout(dp=1, pp=4, grad_accum=8, pp_schedule="gpipe"), 3) == 8


def test_only_dominated_stages_are_skipped_when_looking_for_the_peak() -> None:
    model = MemoryModel(SMALL, MIXED)
    for split in itertools.permutations((1, 2, 2, 2, 3)):
        lo = Layout(dp=1, pp=5, micro_batch=1, grad_accum=5, split=split)
        assert set(candidate_stages(lo, 10)) >= {0, 4}
        assert model.estimate(lo).total == max(s.total for s in model.stages(lo))


def test_the_search_tries_stage_counts_that_do_not_divide_the_layers_and_any_virtual_stage_count() -> None:
    layouts = list(enumerate_layouts(LLAMA_405B, world=128, gpus_per_node=8, global_batch=128, max_micro_batch=1))
    pps = {lo.pp for lo in layouts}
    assert 16 in pps and 32 in pps  # 126 layers: neither divides them
    # 63 layers per stage on 2 stages: every divisor of 63 above 1 is a virtual-stage count (not only 2 or 4).
    virtual = {lo.virtual_stages for lo in layouts if lo.pp == 2 and lo.pp_schedule == "interleaved-1f1b"}
    assert virtual == {3, 7, 9, 21, 63}


def test_the_report_lists_each_stage_and_names_the_peak_stage() -> None:
    from tasks.capacity.report import markdown_report

    text = markdown_report(_plan(LLAMA_405B_SPEC))
    assert "pipeline stages (layers, GiB): 7L " in text
    assert "peak on stage 2 (8 layers)" in text
