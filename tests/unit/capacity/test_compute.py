"""FLOPs and time: Narayanan et al.'s GPT-3 estimate reproduced; recompute costs what it should."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.comm import communication
from tasks.capacity.compute import SECONDS_PER_DAY, compute_time, flops_per_token, narayanan_training_days
from tasks.capacity.memory import Layout, Precision
from tasks.capacity.params import PRESETS, count_params


def test_gpt3_175b_on_300b_tokens_with_1024_a100_at_140_tflops_takes_about_34_days() -> None:
    assert narayanan_training_days(175e9, 300e9, 1024, 140e12) == pytest.approx(33.9, abs=0.05)
    # From the architecture: full recompute (4 passes of the blocks), attention and logits included.
    arch = PRESETS["gpt3-175b"]
    t = compute_time(arch, "full", tokens_per_step=300e9, gpus=1024, peak_flops=140e12, efficiency=1.0)
    assert 33.5 < t.seconds / SECONDS_PER_DAY < 35.5


def test_flops_per_token_are_six_n_plus_attention_and_recompute_adds_a_forward() -> None:
    arch = PRESETS["llama-2-7b"]
    n = count_params(arch).matmul_per_token
    none, full, sel = (flops_per_token(arch, r) for r in ("none", "full", "selective"))
    attention = 12 * arch.n_layers * arch.seq_len * arch.d_model
    assert none.model == pytest.approx(6 * n + attention)
    assert none.hardware == none.model
    head = 2 * arch.vocab_size * arch.d_model
    assert full.hardware - full.model == pytest.approx(none.forward - head)
    assert sel.hardware - sel.model == pytest.approx(attention / 3)


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
    # Per block 2 forward + 5 backward (wq, wk, wv, w1, w3 each all-reduce their input gradient); embedding and
    # output layer one each: what benchmarks/parallel_comm.py counts in the trainer.
    reduces = 7 * arch.n_layers + 2
    assert comm.bytes["tensor_parallel"] == pytest.approx(4 * reduces * per_block * 2 * 7 / 8)
    sp = communication(arch, pc, precision, replace(lo, sequence_parallel=True), CATALOGUE["h100-sxm"], 8, 1.0)
    assert sp.bytes["tensor_parallel"] == pytest.approx(4 * (4 * arch.n_layers + 2) * per_block * 2 * 7 / 8)
    piped = communication(arch, pc, precision, Layout(dp=1, pp=4, grad_accum=8), CATALOGUE["h100-sxm"], 8, 1.0)
    assert piped.bubble_seconds == pytest.approx(3 / 8)


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
    assert pp_bytes(Layout(dp=1, pp=2, grad_accum=8, pp_schedule="interleaved", virtual_stages=2)) == (
        pytest.approx(3 * 8 * boundary)
    )
    moe = replace(arch, n_experts=8, top_k=2)
    mpc = count_params(moe)
    ep = communication(moe, mpc, precision, Layout(dp=2, ep=2), acc, 8, 1.0).bytes["data_parallel"]
    dense_grads = (mpc.total - mpc.experts) * precision.grad_bytes
    assert ep == pytest.approx(dense_grads * 2 * 1 / 2)  # the experts' dp/ep group has one rank: nothing to sync
