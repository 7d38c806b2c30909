"""The time model past FLOPs: memory-bound work from bytes moved at the memory bandwidth, sequence parallelism's
effect on it, recompute of memory-bound work, and communication split into what is hidden and what is exposed."""

from __future__ import annotations

import pytest

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.comm import communication
from tasks.capacity.memory import MemoryModel, Precision, Runtime
from tasks.capacity.params import PRESETS, Architecture, count_params
from tasks.capacity.search import Estimator
from tasks.capacity.timing import block_bytes, head_bytes, memory_bound
from training.layout import Layout

H100 = CATALOGUE["h100-sxm"]
MIXED = Precision.of("bf16", "master-weights")
LLAMA_70B = PRESETS["llama-3.1-70b"]
GPT3 = PRESETS["gpt3-175b"]


def _estimator(arch: Architecture, efficiency: float | None = 0.8, **kwargs: object) -> Estimator:
    memory = MemoryModel(arch, MIXED, Runtime(attention=str(kwargs.pop("attention", "flash"))))  # type: ignore[arg-type]
    return Estimator(arch, memory, H100, 8, 80e9, 0.4, bandwidth_efficiency=efficiency, **kwargs)  # type: ignore[arg-type]


def test_a_fused_block_moves_the_bytes_of_its_norms_residuals_activation_and_rotary_kernels() -> None:
    arch = Architecture(n_layers=1, d_model=8, n_heads=2, ffn_hidden=16, vocab_size=10, seq_len=4, norm_impl="fused")
    fp32 = Precision.of("fp32")
    b = block_bytes(arch, fp32, "flash")
    # two norms (read + write 8 fp32), two residual adds (read two, write one); SwiGLU 5 x 16; q and k rotated
    assert b.replicated == 2 * 2 * 8 * 4 + 2 * 3 * 8 * 4
    assert b.split == 5 * 16 * 4 + 2 * (8 + 8) * 4
    assert b.attention_core == 0  # flash attention's softmax stays on chip
    math = block_bytes(arch, fp32, "math")
    assert math.attention_core == 2 * 2 * 4 * 4  # the score matrices' softmax: heads x seq per token, read + write
    assert head_bytes(arch) == 16 * 10


def test_memory_bound_time_is_its_bytes_at_the_memory_bandwidth_and_adds_to_the_step() -> None:
    lo = Layout(dp=8, micro_batch=1, grad_accum=4)
    with_it, without = _estimator(LLAMA_70B).evaluate(lo), _estimator(LLAMA_70B, None).evaluate(lo)
    moved = memory_bound(LLAMA_70B, MIXED, lo, "flash", 1.0).bytes
    assert with_it.time.memory_bound == pytest.approx(moved / (H100.hbm_tb_s * 1e12 * 0.8))
    assert without.time.memory_bound == 0 and with_it.time.matmul == pytest.approx(without.time.matmul)
    assert with_it.step_seconds > without.step_seconds and with_it.mfu < without.mfu


def test_sequence_parallelism_divides_the_norms_and_residuals_over_the_tensor_parallel_ranks() -> None:
    lo = Layout(dp=1, tp=8, micro_batch=1, grad_accum=1)
    off = memory_bound(LLAMA_70B, MIXED, lo, "flash", 1.0).bytes
    on = memory_bound(LLAMA_70B, MIXED, Layout(dp=1, tp=8, micro_batch=1, grad_accum=1, sequence_parallel=True),
                      "flash", 1.0).bytes  # fmt: skip
    per = block_bytes(LLAMA_70B, MIXED, "flash")
    tokens = LLAMA_70B.seq_len * LLAMA_70B.n_layers
    assert off - on == pytest.approx(tokens * 3 * per.replicated * (1 - 1 / 8))  # forward and backward
    est = _estimator(LLAMA_70B)
    faster = est.evaluate(Layout(dp=1, tp=8, micro_batch=1, grad_accum=1, sequence_parallel=True))
    assert faster.time.memory_bound < est.evaluate(lo).time.memory_bound


def test_recompute_moves_the_recomputed_forward_bytes_again() -> None:
    base = {"dp": 1, "micro_batch": 1, "grad_accum": 1}
    none = memory_bound(GPT3, MIXED, Layout(**base), "math", 1.0)  # type: ignore[arg-type]
    full = memory_bound(GPT3, MIXED, Layout(**base, recompute="full"), "math", 1.0)  # type: ignore[arg-type]
    selective = memory_bound(GPT3, MIXED, Layout(**base, recompute="selective"), "math", 1.0)  # type: ignore[arg-type]
    flash = memory_bound(GPT3, MIXED, Layout(**base, recompute="selective"), "flash", 1.0)  # type: ignore[arg-type]
    per = block_bytes(GPT3, MIXED, "math")
    tokens = GPT3.seq_len * GPT3.n_layers
    assert full.recompute_bytes == pytest.approx(tokens * (per.replicated + per.split))
    assert selective.recompute_bytes == pytest.approx(tokens * per.attention_core)
    assert flash.recompute_bytes == 0
    assert none.bytes < selective.bytes < full.bytes


def test_the_step_is_the_sum_of_its_terms_each_listed() -> None:
    ev = _estimator(GPT3).evaluate(Layout(dp=8, tp=8, pp=12, micro_batch=1, grad_accum=24, recompute="selective"))
    t = ev.time
    assert t.pipeline_parallel > 0 and t.tensor_parallel > 0 and t.bubble > 0 and t.memory_bound > 0
    assert ev.step_seconds == pytest.approx(t.matmul + t.memory_bound + t.data_parallel_exposed + t.tensor_parallel
                                            + t.pipeline_parallel + t.expert_parallel + t.bubble)  # fmt: skip
    assert t.terms()["step_seconds"] == ev.step_seconds


def test_data_parallel_traffic_hides_behind_backward_only_up_to_the_overlap_fraction() -> None:
    lo = Layout(dp=64, micro_batch=1, grad_accum=1)
    arch = PRESETS["llama-3.1-8b"]
    hidden = _estimator(arch).evaluate(lo).time
    half = _estimator(arch, overlap_fraction=0.5).evaluate(lo).time
    none = _estimator(arch, overlap_fraction=0.0).evaluate(lo).time
    assert none.data_parallel_overlapped == 0 and none.data_parallel_exposed > 0
    total = hidden.data_parallel_overlapped + hidden.data_parallel_exposed
    assert half.data_parallel_overlapped + half.data_parallel_exposed == pytest.approx(total)
    assert half.data_parallel_overlapped == pytest.approx(min(total, 0.5 * hidden.compute * 2 / 3))


def test_scatter_gather_divides_the_pipeline_boundary_by_tp_and_gathers_it_over_tp() -> None:
    pc = count_params(GPT3)
    lo = Layout(dp=1, tp=8, pp=4, micro_batch=1, grad_accum=8)
    plain = communication(GPT3, pc, MIXED, lo, H100, 8, 1.0)
    sg = communication(GPT3, pc, MIXED, lo, H100, 8, 1.0, scatter_gather=True)
    assert sg.bytes["pipeline_parallel"] == pytest.approx(plain.bytes["pipeline_parallel"] / 8)
    boundary = GPT3.seq_len * GPT3.d_model * 2
    gathered = 2 * 8 * boundary * 7 / 8  # a middle stage receives two tensors a micro-batch, each all-gathered
    assert sg.bytes["tensor_parallel"] == pytest.approx(plain.bytes["tensor_parallel"] + gathered)
