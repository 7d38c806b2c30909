"""Memory model: ZeRO's model-state table, Korthikanti's activation coefficients, pipeline and KV cache."""

from __future__ import annotations

import pytest

from tasks.capacity.memory import MemoryModel, Precision, Runtime, kv_cache_bytes, layer_activations
from tasks.capacity.params import PRESETS, Architecture
from tasks.capacity.plan import plan_capacity
from tasks.spec import parse_spec
from training.layout import Layout
from tests.conftest import TINY_SPEC, deep_merge
from tests.unit.capacity.papers import korthikanti_bytes_per_layer

MIXED = Precision.of("bf16", "master-weights")


# A 7.5B-parameter model (7,499,681,792) on 8 nodes x 8 H100s, in the planner's own terms.
ZERO_PAPER_SPEC = deep_merge(
    TINY_SPEC,
    {
        "cluster": {"scheduler": "slurm", "nodes": 8, "procs_per_node": 8, "accelerator": "h100-sxm"},
        "model": {"n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "ffn_hidden": 12544,
                  "vocab_size": 51200, "seq_len": 2048},
        "parallel": {"micro_batch": 1},
        "precision": {"dtype": "bf16"},
        "data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"},
    },
)  # fmt: skip


@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_table_for_7_5b_parameters_on_64_gpus(stage: int, gb: float) -> None:
    # Rajbhandari et al. 2020, figure 1: mixed-precision Adam (K = 12), Psi = 7.5B, Nd = 64.
    spec = parse_spec(
        deep_merge(
            ZERO_PAPER_SPEC, {"capacity": {"mixed_precision": "master-weights", "layout": {"zero_stage": stage}}}
        )
    )
    plan = plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)
    assert plan.requested.layout.world == 64 and plan.requested.layout.zero == stage
    assert round(plan.requested.memory.states.total / 1e9, 1) == gb


def _gpt_layer(h: int = 12288, a: int = 96, s: int = 2048) -> Architecture:
    return Architecture(
        n_layers=1, d_model=h, n_heads=a, ffn_hidden=4 * h, vocab_size=51200, seq_len=s, mlp="gelu",
        norm="layernorm", norm_impl="fused", bias=True, positions="learned", dropout=True,
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize(("sp", "recompute"), [(False, "none"), (True, "none"), (True, "selective"), (False, "full")])
def test_gpt_layer_inventory_equals_korthikanti_table_2(tp: int, sp: bool, recompute: str) -> None:
    s, b, h, a = 2048, 1, 12288, 96
    acts = layer_activations(_gpt_layer(h, a, s), MIXED, Runtime(attention="math"), recompute)  # type: ignore[arg-type]
    assert acts.bytes(b, s, tp, sp) == pytest.approx(korthikanti_bytes_per_layer(s, b, h, a, tp, sp, recompute))  # type: ignore[arg-type]


def test_korthikanti_coefficients() -> None:
    s, b, h, a, t = 2048, 4, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_bytes_per_layer(s, b, h, a, 1, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert korthikanti_bytes_per_layer(s, b, h, a, t, False, "none") == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert korthikanti_bytes_per_layer(s, b, h, a, t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert korthikanti_bytes_per_layer(s, b, h, a, t, True, "selective") == pytest.approx(sbh * 34 / t)
    assert korthikanti_bytes_per_layer(s, b, h, a, 1, False, "full") == pytest.approx(2 * sbh)


def test_flash_attention_keeps_no_score_matrix() -> None:
    arch = _gpt_layer()
    math = layer_activations(arch, MIXED, Runtime(attention="math"), "none")
    flash = layer_activations(arch, MIXED, Runtime(attention="flash"), "none")
    assert math.seq_split > 0 and flash.seq_split == 0
    assert flash.bytes(1, 2048, 1, False) < math.bytes(1, 2048, 1, False) / 3


def test_first_pipeline_stage_holds_p_micro_batches_and_interleaving_adds_a_share() -> None:
    arch = PRESETS["llama-2-7b"]
    model = MemoryModel(arch, MIXED)
    per_layer = layer_activations(arch, MIXED, Runtime(), "selective").bytes(1, arch.seq_len, 1, False)
    base = {"dp": 1, "pp": 4, "micro_batch": 1, "grad_accum": 8, "recompute": "selective"}
    one_f_one_b = model.stage(Layout(**base), "first")  # type: ignore[arg-type]
    interleaved = model.stage(Layout(**base, pp_schedule="interleaved-1f1b", virtual_stages=2), "first")  # type: ignore[arg-type]
    # 1F1B: p micro-batches x L/p layers = L layers' activations (Korthikanti et al. 2022, section 4.2.3).
    assert one_f_one_b.activations == pytest.approx(arch.n_layers * per_layer, rel=0.02)
    assert interleaved.activations == pytest.approx(one_f_one_b.activations * (1 + 3 / 8), rel=0.02)


def test_memory_per_gpu_falls_with_each_zero_stage_and_with_tensor_parallelism() -> None:
    model = MemoryModel(PRESETS["llama-3.1-8b"], MIXED)
    totals = [model.estimate(Layout(dp=8, zero=z, micro_batch=1)).total for z in range(4)]
    assert totals == sorted(totals, reverse=True)
    no_tp = model.estimate(Layout(dp=8, micro_batch=1, recompute="selective"))
    tp = model.estimate(Layout(dp=4, tp=2, micro_batch=1, recompute="selective", sequence_parallel=True))
    assert tp.activations < no_tp.activations / 1.9 and tp.weights == pytest.approx(no_tp.weights / 2, rel=0.01)


def test_expert_parallelism_spreads_expert_weights() -> None:
    model = MemoryModel(PRESETS["mixtral-8x7b"], MIXED)
    one = model.estimate(Layout(dp=8, micro_batch=1, zero=1))
    eight = model.estimate(Layout(dp=8, ep=8, micro_batch=1, zero=1))
    assert eight.weights < one.weights / 4


def test_kv_cache_of_llama_2_7b_is_half_a_mib_per_token_in_fp16() -> None:
    assert kv_cache_bytes(PRESETS["llama-2-7b"], batch=1, context=4096) == 2 * 2**30
    assert kv_cache_bytes(PRESETS["llama-3.1-8b"], batch=1, context=4096) == 2 * 2**30 / 4  # GQA: 8 of 32 heads


def test_autocast_keeps_fp32_states_and_16_bit_weight_copies() -> None:
    p = Precision.of("bf16")
    assert (p.weight_bytes, p.grad_bytes, p.optimizer_bytes, p.weight_copy_bytes) == (4, 4, 8, 2)
    assert Precision.of("fp32").weight_copy_bytes == 0
