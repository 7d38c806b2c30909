"""Context parallelism in the plan, against the Llama 3 405B training layouts.

Source: Llama Team 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4, "Scaling configurations and
MFU for each stage of Llama 3 405B pre-training" (columns GPUs, TP, CP, PP, DP, sequence length, batch size per
DP rank, tokens per batch, TFLOPs per GPU, BF16 MFU), with the paper's section 3.3.2 on context parallelism: the
sequence is split in 2 x CP chunks (each rank takes one from either end, balancing the causal mask) and keys and
values are all-gathered over the CP group before attention, their gradients reduce-scattered in backward.

Table 4's MFU column is its TFLOPs column over the H100's dense bf16 peak (989 TFLOP/s) for the first and third
rows (430 -> 43%, 380 -> 38%); the second row prints 41% for 400 TFLOPs, which is 40.4% of 989: the test checks
each row's MFU to one percentage point and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.comm import communication
from tasks.capacity.memory import MemoryModel, Precision
from tasks.capacity.params import count_params
from tasks.capacity.payload import payload_problems
from tasks.capacity.plan import CapacityPlan, plan_capacity
from tasks.capacity.search import enumerate_layouts
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.unit.capacity.test_pipeline_split import LLAMA_405B, LLAMA_405B_SPEC
from training.config import ModelConfig
from training.layout import Layout

H100 = CATALOGUE["h100-sxm"]
MIXED = Precision.of("bf16", "master-weights")


@dataclass(frozen=True)
class Row:
    """One row of Table 4."""

    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq: int
    batch_per_dp: int
    tflops: int
    mfu_pct: int


TABLE_4 = [
    Row(8192, 8, 1, 16, 64, 8192, 32, 430, 43),
    Row(16384, 8, 1, 16, 128, 8192, 16, 400, 41),
    Row(16384, 8, 16, 16, 8, 131072, 16, 380, 38),
]
SIXTEEN_M = 16 * 2**20  # "16M" tokens per batch


def _plan(row: Row) -> CapacityPlan:
    raw = deep_merge(
        LLAMA_405B_SPEC,
        {
            "cluster": {"nodes": row.gpus // 8},
            "model": {"seq_len": row.seq},
            "capacity": {"layout": {"context_parallel": row.cp}, "global_batch": row.dp * row.batch_per_dp},
            "parallel": {"grad_accum_steps": row.batch_per_dp},
        },
    )
    spec = parse_spec(raw)
    return plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)


@pytest.mark.parametrize("row", TABLE_4, ids=lambda r: f"{r.gpus} GPUs cp{r.cp} s{r.seq}")
def test_each_table4_layout_is_planned_with_its_degrees_and_sixteen_million_tokens_a_batch(row: Row) -> None:
    lo = _plan(row).requested.layout
    assert (lo.tp, lo.cp, lo.pp, lo.dp) == (row.tp, row.cp, row.pp, row.dp)
    assert lo.world == row.gpus == row.tp * row.cp * row.pp * row.dp
    assert lo.global_batch * row.seq == SIXTEEN_M  # Table 4's "Tokens/Batch"
    assert (" cp16" in lo.describe()) == (row.cp == 16)


@pytest.mark.parametrize("row", TABLE_4, ids=lambda r: f"{r.tflops} TFLOPs")
def test_table4_mfu_is_its_tflops_over_the_h100_bf16_peak_to_a_point(row: Row) -> None:
    assert H100.peak_tflops_bf16 == 989
    assert abs(100 * row.tflops / H100.peak_tflops_bf16 - row.mfu_pct) <= 1.0  # 400/989 = 40.4%, printed 41%


def test_context_parallel_16_at_131072_tokens_stores_the_activations_of_8192_token_sequences() -> None:
    short, long = _plan(TABLE_4[1]), _plan(TABLE_4[2])
    # Each CP rank holds 131072 / 16 = 8192 tokens of its sequence: flash attention keeps nothing quadratic, so
    # the stored activations per micro-batch are the 8K layout's. The K/V gathered for attention are transient.
    assert long.requested.layout.micro_batch == short.requested.layout.micro_batch == 1
    assert long.requested.memory.activations_stored == pytest.approx(short.requested.memory.activations_stored)
    kv_whole_sequence = 2 * 131072 * LLAMA_405B.kv_dim / 8 * 2
    assert long.requested.memory.transient >= kv_whole_sequence


def test_without_context_parallel_the_long_sequence_stores_sixteen_times_more() -> None:
    model = MemoryModel(replace(LLAMA_405B, seq_len=131072), MIXED)
    lo = Layout(dp=8, tp=8, pp=16, cp=16, zero=1, micro_batch=1, grad_accum=16, sequence_parallel=True)
    with_cp = model.estimate(lo).activations_stored
    without = model.estimate(replace(lo, cp=1, dp=128)).activations_stored
    assert without == pytest.approx(16 * with_cp, rel=0.01)  # the output layer's share is per token too


def test_context_parallel_gathers_keys_and_values_per_block_and_micro_batch() -> None:
    arch = replace(LLAMA_405B, seq_len=131072)
    pc = count_params(arch)
    lo = Layout(dp=8, tp=8, pp=16, cp=16, zero=1, micro_batch=1, grad_accum=16, sequence_parallel=True)
    comm = communication(arch, pc, MIXED, lo, H100, 8, compute_seconds=10.0)
    layers = max(lo.stage_layers(arch.n_layers))
    kv = 2 * 131072 * arch.kv_dim / 8 * 2  # keys and values of the whole sequence, 1/TP of the KV heads, bf16
    assert comm.bytes["context_parallel"] == pytest.approx(16 * layers * 2 * kv * 15 / 16)  # gather + its backward
    full = communication(arch, pc, MIXED, replace(lo, recompute="full"), H100, 8, compute_seconds=10.0)
    assert full.bytes["context_parallel"] == pytest.approx(comm.bytes["context_parallel"] * 3 / 2)
    # cp x tp = 128 ranks span 16 nodes: the inter-node links carry it, and it sits on the critical path.
    assert comm.seconds["context_parallel"] == pytest.approx(
        comm.bytes["context_parallel"] / (H100.inter_node_gb_s * 1e9)
    )
    assert comm.exposed_seconds >= comm.seconds["context_parallel"]


def test_context_parallel_ranks_reduce_gradients_and_shard_states_with_the_data_parallel_ranks() -> None:
    model = MemoryModel(LLAMA_405B, MIXED)
    lo = Layout(dp=8, tp=8, pp=16, cp=16, zero=1, micro_batch=1, grad_accum=16)
    same_shard = replace(lo, cp=1, dp=128)
    assert model.estimate(lo).optimizer == pytest.approx(model.estimate(same_shard).optimizer)
    pc = count_params(LLAMA_405B)
    a = communication(LLAMA_405B, pc, MIXED, replace(lo, zero=0), H100, 8, 10.0).bytes["data_parallel"]
    b = communication(LLAMA_405B, pc, MIXED, replace(same_shard, zero=0), H100, 8, 10.0).bytes["data_parallel"]
    assert a == pytest.approx(b)  # an all-reduce over dp x cp = 128 ranks either way


def test_the_step_time_lists_the_context_parallel_term() -> None:
    terms = _plan(TABLE_4[2]).to_json()["requested"]["step_time"]
    assert terms["context_parallel_seconds"] > 0
    others = sum(v for k, v in terms.items() if k not in ("step_seconds", "data_parallel_overlapped_seconds"))
    assert terms["step_seconds"] == pytest.approx(others)


def test_the_search_tries_context_parallel_only_beyond_what_the_payload_runs() -> None:
    arch = replace(LLAMA_405B, seq_len=131072)
    plain = {lo.cp for lo in enumerate_layouts(arch, 1024, 8, 1024, max_micro_batch=1)}
    wider = {lo.cp for lo in enumerate_layouts(arch, 1024, 8, 1024, max_micro_batch=1, context_parallel=True)}
    assert plain == {1} and {2, 16, 128} <= wider
    tiny = parse_spec(TINY_SPEC)
    lo = Layout(dp=1, cp=2, micro_batch=tiny.parallel.micro_batch, grad_accum=1)
    problems = payload_problems(lo, tiny.model, tiny.parallel, "fp32", 1, 2)
    assert [p[0] for p in problems] == [("parallel", "context_parallel")]  # the payload says why it runs 1


def test_a_plan_searching_beyond_the_payload_lists_context_parallel_layouts_for_long_sequences() -> None:
    raw = deep_merge(
        TINY_SPEC,
        {
            "cluster": {"procs_per_node": 4},
            "model": {"seq_len": 256},
            "capacity": {"search_runnable_only": False, "search_top": 1000},
        },
    )
    spec = parse_spec(raw)
    assert isinstance(spec.model, ModelConfig)
    plan = plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)
    assert any(ev.layout.cp > 1 for ev in plan.search.fitting)
    assert all(not plan.runnable(ev) for ev in plan.search.fitting if ev.layout.cp > 1)
