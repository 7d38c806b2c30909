"""FLOPs and time: Narayanan et al.'s GPT-3 estimate reproduced; recompute costs what it should."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.comm import communication
from tasks.capacity.compute import (
    CONVENTIONS,
    SECONDS_PER_DAY,
    budget_time,
    compute_time,
    flops_conventions,
    flops_per_token,
    flops_utilization,
)
from tasks.capacity.memory import Precision
from tasks.capacity.params import PRESETS, count_params
from training.layout import Layout
from tests.unit.capacity.papers import narayanan_tp_bytes_per_layer, narayanan_training_days


def test_gpt3_175b_on_300b_tokens_with_1024_a100_at_140_tflops_takes_about_34_days() -> None:
    assert narayanan_training_days(175e9, 300e9, 1024, 140e12) == pytest.approx(33.9, abs=0.05)
    # From the architecture: full recompute (4 passes of the blocks), attention and logits included.
    arch = PRESETS["gpt3-175b"]
    t = compute_time(arch, "full", tokens_per_step=300e9, gpus=1024, peak_flops=140e12, efficiency=1.0)
    assert 33.5 < t.seconds / SECONDS_PER_DAY < 35.5


def test_flops_per_token_are_six_n_plus_attention_and_recompute_adds_what_it_recomputes() -> None:
    arch = PRESETS["llama-2-7b"]
    n = count_params(arch).matmul_per_token
    none, full, sel = (flops_per_token(arch, r) for r in ("none", "full", "selective"))
    attention = 12 * arch.n_layers * arch.seq_len * arch.d_model
    assert none.model == pytest.approx(6 * n + attention)
    assert none.hardware == none.model
    head = 2 * arch.vocab_size * arch.d_model
    assert full.hardware - full.model == pytest.approx(none.forward - head)
    # Selective recompute adds the model FLOPs' attention term again (Korthikanti et al. 2022 eq. 8, whose ratio
    # reproduces their Table 5 HFU/MFU: tests/unit/capacity/test_published_flops.py); this used to be attention / 3,
    # one forward of the attention core, which puts their 22B model at 42.2% HFU for 41.5% MFU where Table 5 says 43.7%.
    assert sel.hardware - sel.model == pytest.approx(attention)


def test_flops_conventions_count_six_nd_with_and_without_the_vocabulary_and_the_planners_own() -> None:
    arch = PRESETS["llama-3.1-8b"]  # untied: input embedding and output layer are both vocabulary matrices
    pc = count_params(arch)
    tokens = 1e12
    conv = flops_conventions(arch, tokens, "selective")
    assert conv.six_nd == pytest.approx(6 * pc.total * tokens)
    assert conv.six_nd_non_embedding == pytest.approx(6 * (pc.total - 2 * arch.vocab_size * arch.d_model) * tokens)
    per_token = flops_per_token(arch, "selective")
    assert conv.narayanan == pytest.approx(per_token.model * tokens)
    assert conv.hardware == pytest.approx(per_token.hardware * tokens) and conv.hardware > conv.narayanan
    rows = conv.by_convention()
    assert [c.key for c, _ in rows] == [c.key for c in CONVENTIONS]
    assert [flops for _, flops in rows] == [conv.six_nd, conv.six_nd_non_embedding, conv.narayanan, conv.hardware]
    assert all(c.name and c.source for c, _ in rows)


def test_six_nd_of_a_moe_counts_the_parameters_a_token_uses() -> None:
    arch = PRESETS["mixtral-8x7b"]
    pc = count_params(arch)
    conv = flops_conventions(arch, 1e12)
    assert conv.six_nd == pytest.approx(6 * pc.active_per_token * 1e12)
    assert conv.six_nd < 6 * pc.total * 1e12 / 3


def test_budget_time_and_utilization_are_inverse_and_gpt3_takes_narayanans_34_days() -> None:
    t = budget_time(3.14e23, gpus=1024, peak_flops_per_gpu=312e12, mfu=0.45)
    assert t.days == pytest.approx(t.seconds / SECONDS_PER_DAY)
    assert flops_utilization(3.14e23, t.seconds, 1024, 312e12) == pytest.approx(0.45)
    # Narayanan et al. 2021 section 5.1: 8TP FLOPs at 140 TFLOP/s per GPU achieved, 1024 A100s, about 34 days.
    assert budget_time(8 * 300e9 * 175e9, 1024, 312e12, 140 / 312).days == pytest.approx(33.9, abs=0.05)


def test_moe_flops_follow_the_active_experts() -> None:
    arch = PRESETS["mixtral-8x7b"]
    assert flops_per_token(arch).model < 6 * count_params(arch).total / 3


def test_data_parallel_traffic_of_ddp_is_twice_the_gradients_and_warns_when_it_dominates() -> None:
    arch = PRESETS["llama-3.1-8b"]
    pc = count_params(arch)
    precision = Precision.of("bf16", "master-weights")
    slow = CATALOGUE["l40s"]
    lo = Layout(dp=16, micro_batch=1, grad_accum=1)
    comm = communication(arch, pc, precision, lo, slow, gpus_per_node=8, compute_seconds=1.0)
    assert comm.bytes["data_parallel"] == pytest.approx(2 * 15 / 16 * pc.total * 2)
    # 16 GPUs on two nodes: the ring runs at the inter-node bandwidth.
    assert comm.seconds["data_parallel"] == pytest.approx(comm.bytes["data_parallel"] / (slow.inter_node_gb_s * 1e9))
    assert comm.warnings and "communication would dominate" in comm.warnings[0]


def test_tensor_parallel_traffic_counts_the_payloads_all_reduces_and_pipeline_adds_a_bubble() -> None:
    arch = PRESETS["llama-2-7b"]
    pc = count_params(arch)
    precision = Precision.of("bf16", "master-weights")
    lo = Layout(dp=1, tp=8, micro_batch=1, grad_accum=4)
    comm = communication(arch, pc, precision, lo, CATALOGUE["h100-sxm"], 8, compute_seconds=1.0)
    per_block = arch.seq_len * arch.d_model * 2
    loss = 3 * arch.seq_len * 4  # loss_parallel's fp32 max, sum of exponentials and target logit per token
    # Per block 2 forward + 2 backward (one per region each way); embedding and output layer one each: what
    # benchmarks/parallel_comm.py counts in the trainer.
    reduces = 4 * arch.n_layers + 2
    assert comm.bytes["tensor_parallel"] == pytest.approx(4 * (reduces * per_block + loss) * 2 * 7 / 8)
    sp = communication(arch, pc, precision, replace(lo, sequence_parallel=True), CATALOGUE["h100-sxm"], 8, 1.0)
    assert sp.bytes["tensor_parallel"] == pytest.approx(comm.bytes["tensor_parallel"])
    piped = communication(arch, pc, precision, Layout(dp=1, pp=4, grad_accum=8), CATALOGUE["h100-sxm"], 8, 1.0)
    assert piped.bubble_seconds == pytest.approx(3 / 8)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_bytes_per_layer_are_narayanans_8bsh(sequence_parallel: bool) -> None:
    # GPT-3 175B, b=1, TP 8, bf16: 3.52e8 bytes per layer and micro-batch (the payload sent 5.28e8 when each
    # column-wise projection all-reduced its own input gradient: 2 + 3 + 1 all-reduces instead of 4).
    arch = PRESETS["gpt3-175b"]
    precision = Precision.of("bf16", "master-weights")
    lo = Layout(dp=1, tp=8, micro_batch=1, grad_accum=1, sequence_parallel=sequence_parallel)

    def tp_bytes(a: object) -> float:
        return communication(a, count_params(a), precision, lo, CATALOGUE["h100-sxm"], 8, 1.0).bytes["tensor_parallel"]

    per_layer = tp_bytes(arch) - tp_bytes(replace(arch, n_layers=arch.n_layers - 1))
    oracle = narayanan_tp_bytes_per_layer(b=1, s=arch.seq_len, h=arch.d_model, tp=8, bytes_per_value=2)
    assert oracle == pytest.approx(3.52e8, rel=1e-3)
    assert per_layer == pytest.approx(oracle)


def test_pipeline_bytes_are_the_busiest_ranks_and_experts_sync_over_the_ranks_that_share_them() -> None:
    arch = PRESETS["llama-2-7b"]
    pc = count_params(arch)
    precision = Precision.of("bf16", "master-weights")
    acc = CATALOGUE["h100-sxm"]
    boundary = arch.seq_len * arch.d_model * 2

    def pp_bytes(lo: Layout) -> float:
        return communication(arch, pc, precision, lo, acc, 8, 1.0).bytes["pipeline_parallel"]

    # Two stages: each rank sends one direction (activations or gradients); a middle stage sends both.
    assert pp_bytes(Layout(dp=1, pp=2, grad_accum=8)) == pytest.approx(8 * boundary)
    assert pp_bytes(Layout(dp=1, pp=4, grad_accum=8)) == pytest.approx(16 * boundary)
    assert pp_bytes(Layout(dp=1, pp=2, grad_accum=8, pp_schedule="interleaved-1f1b", virtual_stages=2)) == (
        pytest.approx(3 * 8 * boundary)
    )
    moe = replace(arch, n_experts=8, top_k=2)
    mpc = count_params(moe)
    ep = communication(moe, mpc, precision, Layout(dp=2, ep=2), acc, 8, 1.0).bytes["data_parallel"]
    dense_grads = (mpc.total - mpc.experts) * precision.grad_bytes
    assert ep == pytest.approx(dense_grads * 2 * 1 / 2)  # the experts' dp/ep group has one rank: nothing to sync
