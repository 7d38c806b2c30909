"""The `capacity` spec section: defaults keep specs valid; bad input names the field, the value and the fix."""

from __future__ import annotations

import pytest

from tasks.spec import SpecError, load_spec, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge

BASE = deep_merge(
    TINY_SPEC,
    {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}},
)
FULL_ENTRY = {
    "kind": "gpu",
    "memory_gib": 96,
    "peak_tflops_bf16": 900,
    "peak_tflops_fp16": 900,
    "peak_tflops_fp32": 60,
    "hbm_tb_s": 4.0,
    "intra_node_gb_s": 400,
    "inter_node_gb_s": 50,
}


def _problems(overrides: dict) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(deep_merge(BASE, overrides))
    return err.value.problems


def test_the_embedded_default_spec_validates_with_capacity_defaults() -> None:
    spec = load_spec(REPO / "examples" / "local.yaml")
    assert spec.capacity.headroom_fraction == 0.1 and spec.capacity.layout is None


def test_an_unknown_accelerator_is_refused_with_the_catalogue_names() -> None:
    (problem,) = _problems({"cluster": {"accelerator": "h800"}})
    assert problem.startswith("cluster.accelerator=h800: is not in the accelerator catalogue; use one of a100-40gb")
    assert "h100-sxm" in problem and "mi300x" in problem and "capacity.accelerators" in problem


def test_an_accelerator_described_in_the_spec_is_accepted_and_a_partial_one_names_what_is_missing() -> None:
    spec = parse_spec(
        deep_merge(BASE, {"cluster": {"accelerator": "x1"}, "capacity": {"accelerators": {"x1": FULL_ENTRY}}})
    )
    assert spec.capacity.accelerators["x1"].memory_gib == 96
    partial = {k: v for k, v in FULL_ENTRY.items() if k not in ("hbm_tb_s", "inter_node_gb_s")}
    problems = _problems({"cluster": {"accelerator": "x1"}, "capacity": {"accelerators": {"x1": partial}}})
    assert problems == [
        "capacity.accelerators.x1=x1: is not in the catalogue, so it needs every figure; add hbm_tb_s, inter_node_gb_s"
    ]


def test_a_catalogue_entry_can_be_overridden_in_part() -> None:
    spec = parse_spec(deep_merge(BASE, {"capacity": {"accelerators": {"cpu": {"memory_gib": 4}}}}))
    assert spec.capacity.accelerator_overrides() == {"cpu": {"memory_gib": 4.0}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"capacity": {"layout": {"tensor_parallel": 3}}},
            "capacity.layout.tensor_parallel=3: tensor_parallel x pipeline_parallel = 3 must divide cluster.nodes x "
            "cluster.procs_per_node = 2; with those processes use a product among 1, 2",
        ),
        (
            {"cluster": {"procs_per_node": 8}, "capacity": {"layout": {"tensor_parallel": 8}}},
            "capacity.layout.tensor_parallel=8: must divide model.n_heads=4 (each rank takes whole heads); use 1, 2",
        ),
        (
            {"cluster": {"procs_per_node": 8}, "capacity": {"layout": {"tensor_parallel": 4}}},
            "capacity.layout.tensor_parallel=4: must divide model.n_kv_heads=2 (KV heads are split, not replicated, "
            "over the tensor-parallel ranks); use 1, 2, or raise n_kv_heads to a multiple of 4",
        ),
        (
            {"capacity": {"layout": {"pipeline_parallel": 3}}},
            "capacity.layout.pipeline_parallel=3: tensor_parallel x pipeline_parallel = 3 must divide cluster.nodes x "
            "cluster.procs_per_node = 2; with those processes use a product among 1, 2",
        ),
        (
            {"capacity": {"layout": {"expert_parallel": 2}}},
            "capacity.layout.expert_parallel=2: needs model.moe (a dense model has no experts); set 1",
        ),
        (
            {"capacity": {"layout": {"sequence_parallel": True}}},
            "capacity.layout.sequence_parallel=true: needs tensor_parallel > 1; remove it or raise it",
        ),
        (
            {"capacity": {"global_batch": 7}},
            "capacity.global_batch=7: must be a multiple of data-parallel degree 2 x parallel.micro_batch 4 = 8",
        ),
        ({"capacity": {"headroom_fraction": 1.5}}, "capacity.headroom_fraction=1.5: must be < 1"),
        ({"capacity": {"mfu": 0}}, "capacity.mfu=0: must be > 0"),
        ({"capacity": {"layout": {"zero_stage": 5}}}, "capacity.layout.zero_stage=5: must be one of 0, 1, 2 or 3"),
        ({"model": {"n_layers": 0}}, "model.n_layers=0: must be >= 1"),
        ({"capacity": {"planner": True}}, "capacity.planner=true: is not a known field; remove it"),
        (
            {"capacity": {"optimizer": "lion"}},
            "capacity.optimizer=lion: must be one of 'adamw', 'sgd-momentum', 'adafactor' or 'adam-8bit'",
        ),
        (
            {"capacity": {"mixed_precision": "fp8"}},
            "capacity.mixed_precision=fp8: must be one of 'autocast', 'master-weights' or 'pure-16bit'",
        ),
        ({"capacity": {"grad_dtype": "bf16"}}, "capacity.grad_dtype=bf16: must be one of 'fp32'"),
        (
            {"capacity": {"offload": "nvme"}},
            "capacity.offload=nvme: must be one of 'none', 'optimizer' or 'optimizer+params'",
        ),
        ({"capacity": {"host_memory_gib": 0}}, "capacity.host_memory_gib=0: must be > 0"),
        (
            {"capacity": {"offload": "optimizer", "layout": {"zero_stage": 0}}},
            "capacity.offload=optimizer: offloading the optimizer needs ZeRO-1 or higher (DeepSpeed's "
            "offload_optimizer), but capacity.layout.zero_stage=0; set capacity.layout.zero_stage to 1, 2 or 3, "
            "or offload: none",
        ),
        (
            {"capacity": {"offload": "optimizer+params", "layout": {"zero_stage": 2}}},
            "capacity.offload=optimizer+params: offloading parameters needs ZeRO-3 (DeepSpeed's offload_param, "
            "FSDP2's CPUOffloadPolicy), but capacity.layout.zero_stage=2; set capacity.layout.zero_stage: 3, "
            "or offload: optimizer",
        ),
        (
            {"capacity": {"offload": "optimizer+params", "layout": {"zero_stage": 0}}},
            "capacity.offload=optimizer+params: offloading parameters needs ZeRO-3 (DeepSpeed's offload_param, "
            "FSDP2's CPUOffloadPolicy), but capacity.layout.zero_stage=0; set capacity.layout.zero_stage: 3, "
            "or offload: none",
        ),
        (
            {"capacity": {"layout": {"context_parallel": 3}}},
            "capacity.layout.context_parallel=3: model.seq_len=32 must split in 2 x context_parallel = 6 equal "
            "chunks (load-balanced causal attention); use 1 or 2",
        ),
        (
            {"capacity": {"attention": "math", "layout": {"context_parallel": 2}}},
            "capacity.layout.context_parallel=2: needs capacity.attention: flash",
        ),
        (
            {"capacity": {"layout": {"context_parallel": 4}}},
            "capacity.layout.context_parallel=4: tensor_parallel x pipeline_parallel x context_parallel = 4 must "
            "divide cluster.nodes x cluster.procs_per_node = 2; with those processes use a product among 1, 2",
        ),
        ({"capacity": {"layout": {"context_parallel": 0}}}, "capacity.layout.context_parallel=0: must be >= 1"),
        (
            {"acceptance": {"thresholds": {"plan_max_rel_error": 0}}},
            "acceptance.thresholds.plan_max_rel_error=0: must be > 0",
        ),
        (
            {"acceptance": {"thresholds": {"plan_finding_runs": 0}}},
            "acceptance.thresholds.plan_finding_runs=0: must be >= 1",
        ),
    ],
)
def test_bad_capacity_input_names_field_value_and_fix(overrides: dict, message: str) -> None:
    problems = _problems(overrides)
    assert any(p.startswith(message) for p in problems), problems


def test_offload_at_a_stage_that_can_do_it_is_accepted() -> None:
    spec = parse_spec(deep_merge(BASE, {"capacity": {"offload": "optimizer+params", "layout": {"zero_stage": 3}}}))
    assert spec.capacity.offload == "optimizer+params"
    assert spec.capacity.spec_problems(spec.precision.dtype, spec.parallel.sharding) == []


@pytest.mark.parametrize(
    ("overrides", "messages"),
    [
        (
            {"capacity": {"mixed_precision": "pure-16bit"}},
            ["capacity.mixed_precision=pure-16bit: keeps 16-bit weights, but precision.dtype=fp32 trains in fp32; "
             "set precision.dtype: bf16 (or fp16), or mixed_precision: autocast"],
        ),
        (
            {"capacity": {"offload": "optimizer"}},
            ["capacity.offload=optimizer: offloading the optimizer needs ZeRO-1 or higher (DeepSpeed's "
             "offload_optimizer), but parallel.sharding=ddp is ZeRO-0; set parallel.sharding: fsdp, or "
             "capacity.layout.zero_stage to 1, 2 or 3, or offload: none"],
        ),
        ({"capacity": {"offload": "optimizer+params"}, "parallel": {"sharding": "fsdp"}}, []),
        ({"capacity": {"offload": "optimizer", "layout": {"zero_stage": 1}}}, []),  # the layout's stage decides
        ({"capacity": {"mixed_precision": "pure-16bit"}, "precision": {"dtype": "bf16"}}, []),
    ],
)  # fmt: skip
def test_capacity_choices_that_other_sections_contradict_name_both_and_the_fix(
    overrides: dict, messages: list[str]
) -> None:
    if not messages:
        parse_spec(deep_merge(BASE, overrides))
        return
    assert _problems(overrides) == messages  # the spec refuses them before any work starts


def test_expert_parallel_must_divide_experts_and_data_parallel_degree() -> None:
    problems = _problems(
        {
            "cluster": {"procs_per_node": 4},
            "model": {"moe": {"n_experts": 6, "top_k": 2}},
            "capacity": {"layout": {"expert_parallel": 4}},
        }
    )
    assert problems == ["capacity.layout.expert_parallel=4: must divide model.moe.n_experts=6; use 1, 2, 3, 6"]
    problems = _problems(
        {
            "cluster": {"procs_per_node": 4},
            "model": {"moe": {"n_experts": 8, "top_k": 2}},
            "capacity": {"layout": {"expert_parallel": 4, "tensor_parallel": 2}},
        }
    )
    assert problems == [
        "capacity.layout.expert_parallel=4: expert-parallel ranks are data-parallel ranks: it must divide the "
        "data-parallel degree 2; use 1, 2"
    ]
