"""Serving plans: vLLM's KV-cache sizing reproduced by hand for Llama 3 shapes, GQA, tensor parallelism, problems."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.params import Architecture
from tasks.capacity.serving import (
    ServingSettings,
    kv_block_bytes,
    max_concurrency,
    plan_serving,
    serving_activations,
    serving_memory,
    serving_weight_bytes,
    vllm_batch_defaults,
)
from tasks.serve.config import ServeConfig

GIB = 2**30
MIB = 2**20

LLAMA3_8B = Architecture(
    n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256, seq_len=8192,
    name="llama-3-8b",
)  # fmt: skip
LLAMA3_70B = Architecture(
    n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=128256, seq_len=8192,
    name="llama-3-70b",
)  # fmt: skip
LLAMA2_7B = Architecture(
    n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, vocab_size=32000, seq_len=4096, name="llama-2-7b"
)
GPU_80GIB = CATALOGUE["a100-80gb"]  # 80.0 GiB
# vLLM's OpenAI-server defaults on an A100 (2048 tokens per prefill chunk, 256 sequences), 1 GiB of overhead.
SETTINGS = ServingSettings(dtype="bfloat16", max_num_batched_tokens=2048, max_num_seqs=256, overhead_gib=1.0)

# Llama 3 8B in bf16 by hand:
#   parameters 8,030,261,248 (untied output layer) x 2 bytes     = 16,060,522,496 bytes (~16.06 GB, 14.96 GiB)
#   KV per token: 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes = 128 KiB; a 16-token block 2 MiB
#   prefill of 2048 tokens: stream 2 x 2048 x 4096 x 2 + SwiGLU 2048 x 3 x 14336 x 2 = 209,715,200 bytes = 200 MiB
#   budget 80 GiB x 0.9 = 72 GiB; KV budget 72 GiB - weights - 200 MiB - 1 GiB = 59,965,431,808 bytes
#   blocks 59,965,431,808 // 2 MiB = 28,593; an 8192-token sequence takes 512 blocks: 28,593 // 512 = 55 sequences
WEIGHTS_8B = 16_060_522_496
KV_BUDGET_8B = 72 * GIB - WEIGHTS_8B - 200 * MIB - GIB


def test_llama_3_8b_caches_128_kib_per_token_in_2_mib_blocks() -> None:
    mem = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, SETTINGS)
    assert mem.kv_bytes_per_token == 2 * 32 * 1024 * 2 == 128 * 1024
    assert mem.block_bytes == kv_block_bytes(LLAMA3_8B, 16, 2) == 2 * MIB
    assert mem.blocks_per_sequence == 8192 // 16 == 512
    assert mem.kv_cache == 8192 * 128 * 1024 == GIB
    # vLLM allocates whole blocks: one token past 512 blocks takes a 513th.
    longer = serving_memory(LLAMA3_8B, GPU_80GIB, 8193, 1, SETTINGS)
    assert longer.blocks_per_sequence == 513 and longer.kv_cache == 513 * 2 * MIB


def test_llama_3_8b_weights_in_bf16_take_about_16_gb_and_in_fp32_twice_that() -> None:
    assert serving_weight_bytes(LLAMA3_8B, "bfloat16") == WEIGHTS_8B
    assert serving_weight_bytes(LLAMA3_8B, "float32") == 2 * WEIGHTS_8B
    tied = replace(LLAMA3_8B, tie_embeddings=True)  # the output layer is the embedding: counted once
    assert serving_weight_bytes(tied, "bfloat16") == WEIGHTS_8B - 128256 * 4096 * 2


def test_llama_3_8b_fits_55_sequences_of_8192_tokens_on_an_80_gib_gpu_at_0_9_utilization() -> None:
    mem = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 55, SETTINGS)
    assert mem.budget == 72 * GIB and mem.reserved == 8 * GIB
    assert mem.weights == WEIGHTS_8B
    assert mem.activations.peak == 200 * MIB
    assert mem.overhead == GIB
    assert mem.kv_budget == KV_BUDGET_8B == 59_965_431_808
    assert mem.num_blocks == 28_593
    assert mem.max_concurrency == 55 == max_concurrency(LLAMA3_8B, GPU_80GIB, 8192, SETTINGS)
    assert mem.fits and mem.problems == ()


@pytest.mark.parametrize(
    ("arch", "context", "accelerator"),
    [
        (LLAMA3_8B, 8192, "a100-80gb"),
        (LLAMA3_8B, 131072, "h100-sxm"),
        (LLAMA2_7B, 4096, "a100-40gb"),
        (LLAMA2_7B, 1000, "l40s"),  # a context that is not a whole number of blocks
    ],
)
def test_the_concurrency_is_the_largest_that_fits_and_one_more_does_not(
    arch: Architecture, context: int, accelerator: str
) -> None:
    acc = CATALOGUE[accelerator]
    n = max_concurrency(arch, acc, context, SETTINGS)
    assert n >= 1
    fits, over = (serving_memory(arch, acc, context, c, SETTINGS) for c in (n, n + 1))
    assert fits.fits and fits.used <= fits.budget
    assert not over.fits and over.used > over.budget
    assert [p.kind for p in over.problems] == ["concurrency"]
    assert over.problems[0].message.startswith(f"concurrent={n + 1}: ")
    assert f"use concurrent <= {n}" in over.problems[0].message


def test_gqa_with_a_quarter_of_the_kv_heads_caches_a_quarter_of_the_bytes() -> None:
    mha = replace(LLAMA3_8B, n_kv_heads=32)
    gqa_mem, mha_mem = (serving_memory(a, GPU_80GIB, 8192, 8, SETTINGS) for a in (LLAMA3_8B, mha))
    assert mha_mem.block_bytes == 4 * gqa_mem.block_bytes == 8 * MIB
    assert mha_mem.kv_cache == 4 * gqa_mem.kv_cache == 4 * 8 * GIB
    assert mha_mem.max_concurrency <= gqa_mem.max_concurrency // 4


def test_tensor_parallel_2_halves_the_weights_and_the_kv_cache_per_gpu() -> None:
    tp1, tp2 = (serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 8, replace(SETTINGS, tensor_parallel=tp)) for tp in (1, 2))
    # Norms stay whole on each rank: 32 blocks x 2 x 4096 + the final 4096 = 266,240 parameters.
    assert tp2.weights == ((8_030_261_248 - 266_240) / 2 + 266_240) * 2 == 8_030_527_488
    assert tp2.block_bytes == tp1.block_bytes / 2 == MIB
    assert tp2.kv_cache == tp1.kv_cache / 2
    assert tp2.activations.mlp == tp1.activations.mlp / 2
    assert tp2.activations.stream == tp1.activations.stream  # the residual stream is whole on every rank
    assert tp2.max_concurrency > 2 * tp1.max_concurrency  # half the KV per rank, and more room beside the weights


def test_more_ranks_than_kv_heads_keep_one_replicated_kv_head_per_rank() -> None:
    # 8 KV heads over 16 ranks: each rank caches 1 head, as with 8 ranks.
    assert kv_block_bytes(LLAMA3_8B, 16, 2, tp=16) == kv_block_bytes(LLAMA3_8B, 16, 2, tp=8) == 2 * 32 * 128 * 16 * 2


def test_prefill_activations_peak_at_the_mlp_and_sampling_at_the_fp32_logits() -> None:
    prefill = serving_activations(LLAMA3_8B, tokens=2048, sequences=256)
    assert prefill.mlp == 2048 * 3 * 14336 * 2 and prefill.stream == 2 * 2048 * 4096 * 2
    assert prefill.attention == 2048 * (4096 + 2 * 1024 + 4096) * 2
    assert prefill.peak == prefill.layer_peak == 200 * MIB
    decode = serving_activations(LLAMA3_8B, tokens=256, sequences=256, dtype="float32")
    assert decode.logits == 256 * 128256 * 4  # fp32 whatever the model's dtype
    assert decode.peak == decode.sampling_peak == 256 * 4096 * 4 + 256 * 128256 * 4


def test_a_model_too_large_for_the_device_reports_its_weights_and_the_tensor_parallel_that_fits() -> None:
    mem = serving_memory(LLAMA3_70B, GPU_80GIB, 8192, 1, SETTINGS)
    assert mem.weights == 70_553_706_496 * 2 > mem.device
    assert mem.max_concurrency == 0
    [problem] = mem.problems
    assert (problem.kind, problem.field, problem.value) == ("weights", "tensor_parallel", 1)
    assert problem.message == (
        "tensor_parallel=1: the weights take 131.42 GiB per GPU in bfloat16, more than the a100-80gb's 80.00 GiB; "
        "use tensor_parallel=2"
    )
    assert serving_memory(LLAMA3_70B, GPU_80GIB, 8192, 1, replace(SETTINGS, tensor_parallel=2)).fits


def test_a_context_whose_one_sequence_does_not_fit_reports_the_longest_that_does() -> None:
    mem = serving_memory(LLAMA3_8B, GPU_80GIB, 1_048_576, 1, SETTINGS)
    assert max_concurrency(LLAMA3_8B, GPU_80GIB, 1_048_576, SETTINGS) == 0
    [problem] = mem.problems
    assert (problem.kind, problem.field, problem.value) == ("context", "context", 1_048_576)
    assert problem.message.startswith("context=1048576: one sequence needs 128.00 GiB of KV cache, the 55.85 GiB")
    assert "use context <= 457488 " in problem.message  # 28,593 blocks x 16 tokens


def test_a_utilization_that_leaves_nothing_for_the_cache_reports_the_utilization_needed() -> None:
    mem = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, replace(SETTINGS, gpu_memory_utilization=0.2))
    assert mem.kv_budget < 0 and mem.num_blocks == 0
    [problem] = mem.problems
    assert (problem.kind, problem.field, problem.value) == ("budget", "gpu_memory_utilization", 0.2)
    # weights + 200 MiB + 1 GiB + one 8192-token sequence (1 GiB) = 18,417,721,344 bytes = 0.2144 of 80 GiB
    assert problem.message.startswith("gpu_memory_utilization=0.2: weights 14.96 GiB + activations 0.20 GiB")
    assert "use gpu_memory_utilization=0.22 or tensor_parallel=2" in problem.message


def test_gpu_memory_utilization_moves_only_the_kv_cache() -> None:
    high, low = (
        serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, replace(SETTINGS, gpu_memory_utilization=u)) for u in (0.9, 0.8)
    )
    assert high.weights == low.weights and high.activations == low.activations
    assert high.kv_budget - low.kv_budget == pytest.approx(8 * GIB)
    assert low.reserved == pytest.approx(16 * GIB)


def test_a_fixed_kv_cache_size_sets_the_blocks_and_must_fit_the_device() -> None:
    mem = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, replace(SETTINGS, kv_cache_gib=20))
    assert mem.num_blocks == 20 * GIB // (2 * MIB) == 10_240 and mem.max_concurrency == 20
    over = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, replace(SETTINGS, kv_cache_gib=70))
    [problem] = over.problems
    assert (problem.kind, problem.field) == ("budget", "kv_cache_gib")
    assert "use kv_cache_gib <= 63.85" in problem.message  # 80 GiB - weights - 200 MiB - 1 GiB


def test_an_fp8_kv_cache_halves_the_bf16_blocks() -> None:
    mem = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, replace(SETTINGS, kv_cache_dtype="fp8"))
    assert mem.block_bytes == MIB
    assert mem.max_concurrency == int(KV_BUDGET_8B // MIB) // 512 == 111


def test_tensor_parallel_that_does_not_split_the_heads_is_reported_with_the_degrees_that_do() -> None:
    [problem] = serving_memory(LLAMA3_8B, GPU_80GIB, 8192, 1, replace(SETTINGS, tensor_parallel=3)).problems
    assert problem.kind == "tensor_parallel"
    assert problem.message.endswith("use one of [1, 2, 4, 8]")


def test_unset_batch_limits_take_vllm_defaults_for_the_device() -> None:
    assert vllm_batch_defaults(CATALOGUE["h100-sxm"]) == (8192, 1024)
    assert vllm_batch_defaults(CATALOGUE["a100-80gb"]) == (2048, 256)
    assert vllm_batch_defaults(CATALOGUE["l40s"]) == (2048, 256)
    mem = serving_memory(LLAMA3_8B, CATALOGUE["h100-sxm"], 8192, 1, ServingSettings())
    assert (mem.activations.tokens, mem.activations.sequences) == (8192, 1024)


def test_plan_serving_takes_the_serve_section_and_names_its_fields() -> None:
    serve = ServeConfig(dtype="bfloat16", max_num_seqs=64, gpu_memory_utilization=0.9)
    plan = plan_serving(LLAMA3_8B, GPU_80GIB, ServingSettings.of(serve, GPU_80GIB), max_model_len=8192)
    assert plan.concurrency == 55 and not plan.fits
    [problem] = plan.problems
    assert problem.field == "serve.max_num_seqs"
    assert problem.message.startswith("serve.max_num_seqs=64: ") and "use serve.max_num_seqs <= 55" in problem.message
    serve_16 = serve.model_copy(update={"max_num_seqs": 16})
    small = plan_serving(LLAMA3_8B, GPU_80GIB, ServingSettings.of(serve_16, GPU_80GIB))
    assert small.fits and small.concurrency == 16 and small.memory.context == LLAMA3_8B.seq_len


def test_on_cpu_the_kv_cache_is_the_whole_gib_the_server_sets() -> None:
    settings = ServingSettings.of(ServeConfig(kv_cache_gib=2.5), CATALOGUE["cpu"])
    assert settings.kv_cache_gib == 2.0
    assert ServingSettings.of(ServeConfig(kv_cache_gib=2.5), GPU_80GIB).kv_cache_gib is None


def test_the_capacity_plan_of_a_spec_that_serves_reports_the_serving_memory_and_concurrency() -> None:
    from tasks.capacity.report import markdown_report
    from tasks.capacity.step import CapacityInputs
    from tasks.spec import parse_spec
    from tests.conftest import TINY_SPEC, deep_merge

    raw = deep_merge(
        TINY_SPEC,
        {
            "cluster": {"scheduler": "slurm", "nodes": 1, "procs_per_node": 8, "accelerator": "h100-sxm"},
            "model": {"n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336,
                      "vocab_size": 128256, "seq_len": 8192},
            "parallel": {"micro_batch": 1, "sharding": "fsdp"},
            "precision": {"dtype": "bf16"},
            "serve": {"dtype": "bfloat16", "max_num_seqs": 64, "max_model_len": 8192},
            "data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"},
        },
    )  # fmt: skip
    plan = CapacityInputs.of(parse_spec(raw)).estimate()
    assert plan.serving is not None
    serving = plan.to_json()["serving"]
    expected = max_concurrency(LLAMA3_8B, CATALOGUE["h100-sxm"], 8192, plan.serving.settings)
    assert serving["max_concurrency"] == expected and 0 < expected < 64
    assert serving["kv_cache_bytes_per_token"] == 2 * 32 * 1024 * 2
    assert any(w.startswith("serving: serve.max_num_seqs=64: ") for w in plan.warnings)
    assert f"{expected} such sequences fit (64 asked)" in markdown_report(plan)
    without = CapacityInputs.of(parse_spec({**raw, "serve": None})).estimate()
    assert without.serving is None and without.to_json()["serving"] is None
