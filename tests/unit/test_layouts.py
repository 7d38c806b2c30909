"""Every bad model-parallel layout is refused at the spec boundary (tasks/spec.py parse_spec) with its own
`field=value: what and the fix` line; a good layout of each kind is accepted."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge

# Four processes on one node and a model that every good layout below divides: 4 layers, 4 heads (4 KV heads),
# ffn 64, vocab 256, seq 32; 8 sequences per rank and step (micro_batch 4 x grad_accum_steps 2).
BASE: dict[str, Any] = deep_merge(
    TINY_SPEC,
    {
        "cluster": {"procs_per_node": 4},
        "model": {"n_layers": 4, "n_kv_heads": 4, "vocab_size": 256},
        "parallel": {"micro_batch": 4, "grad_accum_steps": 2},
        "data": {"dataset_url": "/tmp/tdeploy-layouts/data"},
        "checkpoint": {"url": "/tmp/tdeploy-layouts/checkpoints"},
        "run": {"output_url": "/tmp/tdeploy-layouts/output"},
    },
)
MOE = {"n_experts": 4, "top_k": 2}

GOOD = {
    "tp2 x dp2 with sequence parallel": {"parallel": {"tensor_parallel": 2, "sequence_parallel": True}},
    "pp2 x dp2, 1f1b": {"parallel": {"pipeline_parallel": 2}},
    "pp2 interleaved, 2 virtual stages, uneven": {
        "parallel": {
            "pipeline_parallel": 2,
            "pipeline_schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "pipeline_split": [1, 1, 1, 1],
        },
        "cluster": {"procs_per_node": 2},
    },  # fmt: skip
    "tp2 x pp2": {"parallel": {"tensor_parallel": 2, "pipeline_parallel": 2}},
    "fsdp2 x tp2": {"parallel": {"tensor_parallel": 2, "sharding": "fsdp", "data_parallel": 2}},
    "ep2 with a 4-expert MoE": {"model": {"moe": MOE}, "parallel": {"expert_parallel": 2}},
    "3 layers on 2 stages": {"model": {"n_layers": 3}, "parallel": {"pipeline_parallel": 2}},
}

# name -> (spec overrides, field, value as the message shows it, text of the fix)
BAD: dict[str, tuple[dict[str, Any], str, str, str]] = {
    "heads not divisible by TP": (
        {"cluster": {"procs_per_node": 6}, "model": {"d_model": 48, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96},
         "parallel": {"tensor_parallel": 3}},
        "parallel.tensor_parallel", "3", "must divide model.n_heads=4 (each rank takes whole heads); use 1, 2",
    ),
    "KV heads not divisible by TP": (
        {"model": {"d_model": 64, "n_heads": 8, "n_kv_heads": 2}, "parallel": {"tensor_parallel": 4}},
        "parallel.tensor_parallel", "4", "must divide model.n_kv_heads=2",
    ),
    "ffn_hidden not divisible by TP": (
        {"model": {"ffn_hidden": 66}, "parallel": {"tensor_parallel": 4}},
        "parallel.tensor_parallel", "4", "must divide model.ffn_hidden=66; use 1, 2, 3, 6, 11, 22, 33, 66 or set "
        "ffn_hidden to 68",
    ),
    "vocab not divisible by TP": (
        {"model": {"vocab_size": 257}, "parallel": {"tensor_parallel": 2}},
        "model.vocab_size", "257", "pad the embedding: set model.vocab_size to 258",
    ),
    "more pipeline chunks than layers": (
        {"model": {"n_layers": 2}, "parallel": {"pipeline_parallel": 4, "grad_accum_steps": 4}},
        "parallel.pipeline_parallel", "4", "4 pipeline chunks (pipeline_parallel x virtual_stages) exceed "
        "model.n_layers=2",
    ),
    "pipeline_split of the wrong length": (
        {"parallel": {"pipeline_parallel": 2, "pipeline_split": [1, 1, 2]}},
        "parallel.pipeline_split", "[1, 1, 2]", "must list 2 chunk sizes", ),
    "pipeline_split of the wrong sum": (
        {"parallel": {"pipeline_parallel": 2, "pipeline_split": [1, 2]}},
        "parallel.pipeline_split", "[1, 2]", "summing to model.n_layers=4; for example [2, 2]",
    ),
    "pipeline_split without pipeline stages": (
        {"parallel": {"pipeline_split": [4]}},
        "parallel.pipeline_split", "[4]", "only applies to pipeline_parallel > 1; remove it",
    ),
    "experts not divisible by EP": (
        {"model": {"moe": {"n_experts": 3, "top_k": 1}}, "parallel": {"expert_parallel": 2}},
        "parallel.expert_parallel", "2", "must divide model.moe.n_experts=3; use 1, 3",
    ),
    "EP without MoE": (
        {"parallel": {"expert_parallel": 2}},
        "parallel.expert_parallel", "2", "needs model.moe (a dense model has no experts); set 1",
    ),
    "fewer microbatches than stages": (
        {"parallel": {"pipeline_parallel": 2, "grad_accum_steps": 1}},
        "parallel.pipeline_microbatches", "1", "set pipeline_microbatches (or grad_accum_steps) >= 2",
    ),
    "microbatches that do not divide the step's sequences": (
        {"parallel": {"pipeline_parallel": 2, "pipeline_microbatches": 3}},
        "parallel.pipeline_microbatches", "3", "must divide the 8 sequences of a pipeline step (micro_batch x "
        "grad_accum_steps); use 1, 2, 4, 8",
    ),
    "interleaved without virtual stages": (
        {"parallel": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved-1f1b"}},
        "parallel.virtual_stages", "1", "interleaved-1f1b needs virtual_stages >= 2; set 2",
    ),
    "virtual_stages without interleaved": (
        {"parallel": {"pipeline_parallel": 2, "virtual_stages": 2}},
        "parallel.virtual_stages", "2", "only applies to pipeline_schedule=interleaved-1f1b (got 1f1b); remove it",
    ),
    "SP without TP": (
        {"parallel": {"sequence_parallel": True}},
        "parallel.sequence_parallel", "true", "needs tensor_parallel > 1; remove it or raise it",
    ),
    "SP with seq_len not divisible by TP": (
        {"model": {"seq_len": 30}, "parallel": {"tensor_parallel": 4, "sequence_parallel": True}},
        "parallel.sequence_parallel", "true", "needs model.seq_len=30 divisible by tensor_parallel=4; set seq_len "
        "to 32 or turn sequence_parallel off",
    ),
    "TP x PP not dividing the world": (
        {"cluster": {"procs_per_node": 6}, "parallel": {"tensor_parallel": 2, "pipeline_parallel": 2}},
        "parallel.tensor_parallel", "2", "tensor_parallel x pipeline_parallel = 4 must divide cluster.nodes x "
        "cluster.procs_per_node = 6; with those processes use a product among 1, 2, 3, 6",
    ),
    "data_parallel not world / (TP x PP)": (
        {"parallel": {"tensor_parallel": 2, "data_parallel": 4}},
        "parallel.data_parallel", "4", "must be cluster.nodes x cluster.procs_per_node = 4 / (tensor_parallel x "
        "pipeline_parallel) = 2; set it to 2 or remove it",
    ),
    "a TP group spanning nodes": (
        {"cluster": {"nodes": 2, "procs_per_node": 2}, "parallel": {"tensor_parallel": 4}},
        "parallel.tensor_parallel", "4", "a tensor-parallel group must sit within one node (2 processes per node)",
    ),
    "EP not dividing the data-parallel degree": (
        {"cluster": {"procs_per_node": 6}, "model": {"moe": MOE}, "parallel": {"expert_parallel": 4}},
        "parallel.expert_parallel", "4", "it must divide the data-parallel degree 6; use 1, 2, 3, 6",
    ),
    "HSDP shard not dividing the data-parallel degree": (
        {"parallel": {"tensor_parallel": 2, "sharding": "hsdp", "hsdp_shard_size": 3}},
        "parallel.hsdp_shard_size", "3", "must divide the data-parallel degree 2; use one of [1, 2]",
    ),
    "context parallel": (
        {"parallel": {"context_parallel": 2}},
        "parallel.context_parallel", "2", "context parallelism is not available",
    ),
    "fp16 with model parallelism": (
        {"precision": {"dtype": "fp16"}, "parallel": {"tensor_parallel": 2}},
        "precision.dtype", "fp16", "use bf16 with tensor, pipeline or expert parallelism",
    ),
    "tied embeddings across pipeline stages": (
        {"model": {"tie_embeddings": True}, "parallel": {"pipeline_parallel": 2}},
        "model.tie_embeddings", "true", "set tie_embeddings: false or pipeline_parallel: 1",
    ),
    "MoE with pipeline stages": (
        {"model": {"moe": MOE}, "parallel": {"pipeline_parallel": 2}},
        "parallel.pipeline_parallel", "2", "is not supported with model.moe yet",
    ),
    "MoE with tensor parallelism": (
        {"model": {"moe": MOE}, "parallel": {"tensor_parallel": 2}},
        "parallel.tensor_parallel", "2", "shard experts with parallel.expert_parallel and use tensor_parallel=1",
    ),
}  # fmt: skip


def _problems(overrides: dict[str, Any]) -> list[str]:
    try:
        parse_spec(deep_merge(BASE, overrides), "layout-table")
    except SpecError as err:
        return err.problems
    return []


@pytest.mark.parametrize("overrides", GOOD.values(), ids=GOOD.keys())
def test_each_layout_the_issue_names_is_accepted(overrides: dict[str, Any]) -> None:
    assert _problems(overrides) == []


@pytest.mark.parametrize(("overrides", "field", "value", "fix"), BAD.values(), ids=BAD.keys())
def test_a_bad_layout_is_refused_with_its_field_value_and_fix(
    overrides: dict[str, Any], field: str, value: str, fix: str
) -> None:
    problems = _problems(overrides)
    mine = [p for p in problems if p.startswith(f"{field}={value}: ")]
    assert mine, f"no {field}={value} line among {problems}"
    assert any(fix in p for p in mine), f"the fix {fix!r} is in none of {mine}"


def test_the_summary_shows_the_layout_and_the_data_parallel_global_batch() -> None:
    spec = parse_spec(deep_merge(BASE, {"parallel": {"tensor_parallel": 2, "sequence_parallel": True}}))
    assert spec.data_parallel_degree == 2
    assert "layout dp2 x tp2 (ddp, sp)" in spec.summary() and "(global 16 sequences)" in spec.summary()
    pipeline = parse_spec(deep_merge(BASE, {"parallel": {"pipeline_parallel": 2, "tensor_parallel": 2}}))
    assert pipeline.layout() == "pp2 x dp1 x tp2 (ddp, 1f1b)"
    assert parse_spec(BASE).layout() == "dp4 (ddp)"


def test_a_data_parallel_layout_keeps_its_own_messages() -> None:
    (problem,) = _problems({"parallel": {"data_parallel": 2}})
    assert problem == (
        "parallel.data_parallel=2: must equal cluster.nodes x cluster.procs_per_node = 4; set it to 4 or remove it"
    )
