"""Model states: optimizer choices, gradient and weight precision, CPU offload, DeepSpeed's published estimates."""

from __future__ import annotations

import math

import pytest

from tasks.capacity.memory import MemoryModel, Precision, StageParams, model_states, optimizer_state_bytes, param_shapes
from tasks.capacity.params import PRESETS, Architecture, count_params
from tasks.capacity.plan import plan_capacity
from tasks.capacity.units import GIB
from tasks.spec import parse_spec
from training.layout import Layout
from tests.conftest import deep_merge
from tests.unit.capacity.papers import deepspeed_estimate
from tests.unit.capacity.test_memory import ZERO_PAPER_SPEC

# 7,499,681,792 parameters (the ZeRO paper's 7.5B) on one node of 8 H100s, in the planner's own terms.
SPEC_7_5B = deep_merge(ZERO_PAPER_SPEC, {"cluster": {"nodes": 1}})
P_7_5B = 7_499_681_792

# An architecture small enough to count Adafactor's state by hand: one GeLU block, tied embedding, 8 wide.
SMALL = Architecture(
    n_layers=1, d_model=8, n_heads=2, ffn_hidden=16, vocab_size=10, seq_len=4, mlp="gelu", tie_embeddings=True
)


def _plan(capacity: dict, **sections: dict):
    spec = parse_spec(deep_merge(SPEC_7_5B, {"capacity": {"search_top": 1, **capacity}, **sections}))
    return plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)


def _whole(params: float) -> StageParams:
    return StageParams(dense_layer=0.0, expert_layer=0.0, embed=0.0, head=0.0, dense=params, expert=0.0)


@pytest.mark.parametrize(
    ("dtype", "recipe", "optimizer", "grad_dtype", "bytes_per_param"),
    [
        ("bf16", "master-weights", "adamw", None, (2, 2, 12)),  # ZeRO paper: 2 + 2 + K, K = 12
        ("bf16", "master-weights", "adamw", "fp32", (2, 4, 12)),  # Megatron's main_grad: 18
        ("bf16", "pure-16bit", "adamw", None, (2, 2, 4)),  # no master, 16-bit moments: 8
        ("bf16", "pure-16bit", "adamw", "fp32", (2, 4, 4)),
        ("bf16", "master-weights", "sgd-momentum", None, (2, 2, 8)),  # master + one fp32 buffer
        ("bf16", "pure-16bit", "sgd-momentum", None, (2, 2, 2)),
        ("bf16", "autocast", "sgd-momentum", "fp32", (4, 4, 4)),  # fp32 gradients already
        ("fp32", "autocast", "adamw", None, (4, 4, 8)),
        ("fp32", "pure-16bit", "adamw", None, (4, 4, 8)),  # precision.dtype fp32 trains in fp32
    ],
)
def test_bytes_per_parameter_follow_recipe_optimizer_and_gradient_dtype(
    dtype: str, recipe: str, optimizer: str, grad_dtype: str | None, bytes_per_param: tuple[int, int, int]
) -> None:
    p = Precision.of(dtype, recipe, optimizer, grad_dtype)  # type: ignore[arg-type]
    assert (p.weight_bytes, p.grad_bytes, p.optimizer_bytes) == bytes_per_param
    assert p.master_bytes == (4 if recipe == "master-weights" and dtype != "fp32" else 0)


def test_param_shapes_add_up_to_the_parameter_count_of_every_preset() -> None:
    for arch in [*PRESETS.values(), SMALL]:
        assert sum(math.prod(shape) * n for shape, n in param_shapes(arch)) == count_params(arch).total, arch.name


def test_adafactor_keeps_row_and_column_factors_of_each_matrix_and_full_vectors() -> None:
    # Embedding (10, 8): 10 + 8; q, k, v, o (8, 8): 4 x 16; MLP (16, 8) and (8, 16): 2 x 24; three norms of 8 kept
    # whole: 154 fp32 values for 80 + 256 + 256 + 24 = 616 parameters, no first moment: 1 byte per parameter.
    assert count_params(SMALL).total == 616
    assert optimizer_state_bytes("adafactor", SMALL) == pytest.approx(154 * 4 / 616) == pytest.approx(1.0)
    assert optimizer_state_bytes("adafactor", SMALL, state_bytes=2) == pytest.approx(0.5)
    # At 7B the factors are a rounding error next to AdamW's 8 bytes.
    assert optimizer_state_bytes("adafactor", PRESETS["llama-2-7b"]) < 0.002


def test_adam_8bit_keeps_two_bytes_and_an_fp32_absmax_per_block_and_fp32_states_for_small_tensors() -> None:
    llama = PRESETS["llama-2-7b"]  # every tensor has >= 4096 elements, a multiple of 2048
    assert optimizer_state_bytes("adam-8bit", llama, block=2048) == 2 + 2 * 4 / 2048  # Dettmers et al. 2022
    assert optimizer_state_bytes("adam-8bit", llama) == 2 + 2 * 4 / 256  # bitsandbytes >= 0.44
    assert optimizer_state_bytes("adam-8bit", SMALL) == 8  # all under min_8bit_size=4096: two fp32 moments
    p = Precision.of("bf16", "master-weights", "adam-8bit", arch=llama)
    assert p.optimizer_bytes == 4 + 2 + 2 * 4 / 256


def test_optimizer_choice_scales_the_planned_optimizer_states() -> None:
    arch = PRESETS["llama-3.1-8b"]
    layout = Layout(dp=8, zero=1, micro_batch=1)

    def optimizer_bytes(name: str) -> float:
        precision = Precision.of("bf16", "master-weights", name, arch=arch)  # type: ignore[arg-type]
        return MemoryModel(arch, precision).estimate(layout).optimizer

    adamw = optimizer_bytes("adamw")
    assert optimizer_bytes("sgd-momentum") == pytest.approx(adamw * 8 / 12)
    assert optimizer_bytes("adafactor") == pytest.approx(adamw * 4 / 12, rel=1e-3)  # the master and little else
    assert optimizer_bytes("adam-8bit") == pytest.approx(adamw * (4 + 2 + 8 / 256) / 12, rel=1e-3)


@pytest.mark.parametrize(
    ("capacity", "gb"),
    [
        ({"mixed_precision": "master-weights"}, 120.0),  # 16 bytes x 7.5B: the ZeRO paper's figure 1
        ({"mixed_precision": "master-weights", "grad_dtype": "fp32"}, 135.0),  # 18 bytes
        ({"mixed_precision": "pure-16bit"}, 60.0),  # 8 bytes
        ({"mixed_precision": "pure-16bit", "optimizer": "sgd-momentum"}, 45.0),  # 6 bytes
    ],
)
def test_the_spec_chooses_the_model_states_per_parameter(capacity: dict, gb: float) -> None:
    plan = _plan(capacity | {"layout": {"zero_stage": 0}})
    assert round(plan.requested.memory.states.total / 1e9, 1) == gb


MASTER = Precision.of("bf16", "master-weights")
AUTOCAST = Precision.of("bf16", "autocast")


@pytest.mark.parametrize(
    ("precision", "zero", "offload", "device", "host"),
    [
        # Device (weights, gradients, optimizer) and host bytes, per parameter of the model, on one of 8 ranks.
        (MASTER, 3, "none", (2 / 8, 2 / 8, 12 / 8), 0),
        (MASTER, 3, "optimizer", (2 / 8, 0, 0), (4 + 8 + 4) / 8),  # master, moments, fp32 gradient shard
        (MASTER, 3, "optimizer+params", (0, 0, 0), (2 + 4 + 8 + 4) / 8),
        (MASTER, 2, "optimizer", (2, 0, 0), 16 / 8),
        (MASTER, 2, "optimizer+params", (2, 0, 0), 16 / 8),  # ZeRO-2 cannot offload parameters
        (MASTER, 1, "optimizer", (2, 2, 0), 16 / 8),  # ZeRO-1's unsharded gradients stay until reduced
        (MASTER, 0, "optimizer", (2, 2, 12), 0),  # DDP has no partition to offload
        (AUTOCAST, 3, "optimizer", (4 / 8, 0, 0), (4 + 8 + 4) / 8),  # the host step's own fp32 copy
        (AUTOCAST, 3, "optimizer+params", (0, 0, 0), (4 + 8 + 4) / 8),  # FSDP2 CPUOffloadPolicy: 16 bytes
    ],
)
def test_offload_moves_states_to_the_host_where_the_zero_stage_allows(
    precision: Precision, zero: int, offload: str, device: tuple[float, float, float], host: float
) -> None:
    params = 1e9
    states = model_states(_whole(params), precision, Layout(dp=8, zero=zero), offload)  # type: ignore[arg-type]
    assert (states.weights, states.gradients, states.optimizer) == pytest.approx(tuple(d * params for d in device))
    assert states.host == pytest.approx(host * params)
    assert states.optimizer_params == (params / (8 if zero else 1) if not host else 0.0)  # the step runs there


def test_offload_leaves_the_device_peak_and_plan_json_shows_host_bytes_per_rank_and_node() -> None:
    on_device = _plan({"mixed_precision": "master-weights"}, parallel={"sharding": "fsdp"})
    offloaded = _plan({"mixed_precision": "master-weights", "offload": "optimizer"}, parallel={"sharding": "fsdp"})
    memory = offloaded.requested.memory
    assert memory.states.total == pytest.approx(2 * P_7_5B / 8)
    assert memory.host_bytes == pytest.approx(16 * P_7_5B / 8)
    assert memory.total < on_device.requested.memory.total - 12 * P_7_5B / 8
    host = offloaded.to_json()["requested"]["host_memory"]
    assert host == {
        "per_rank_bytes": pytest.approx(2 * P_7_5B),
        "ranks_per_node": 8,
        "per_node_bytes": pytest.approx(16 * P_7_5B),
        "limit_bytes": None,
        "fits": True,
        "problem": None,
    }
    assert offloaded.to_json()["requested"]["memory"]["host_bytes"] == memory.host_bytes
    assert on_device.to_json()["requested"]["host_memory"]["per_node_bytes"] == 0


def test_offloaded_states_beyond_the_nodes_host_memory_name_the_field_the_value_and_the_fix() -> None:
    capacity = {"mixed_precision": "master-weights", "offload": "optimizer+params"}
    roomy = _plan(capacity | {"host_memory_gib": 1024}, parallel={"sharding": "fsdp"}).host_memory()
    assert roomy.problem is None and roomy.as_dict()["limit_bytes"] == 1024 * GIB
    tight_plan = _plan(capacity | {"host_memory_gib": 100}, parallel={"sharding": "fsdp"})
    tight = tight_plan.host_memory()
    assert tight_plan.requested.fits and not tight_plan.fits  # the device holds it, the host does not
    assert any("do not fit the nodes' host memory" in w for w in tight_plan.warnings)
    assert "capacity.host_memory_gib=100" in str(tight_plan.error())
    # 18 bytes x 7.5B over one node's 8 ranks: 125.7 GiB.
    assert tight.problem == (
        "capacity.host_memory_gib=100: the offloaded model states need 125.7 GiB per node (8 ranks x 15.7 GiB); "
        "raise host_memory_gib to at least 126 if the nodes have it, spread the states over more nodes, or offload "
        "less (capacity.offload)"
    )
    assert tight.as_dict()["fits"] is False


# DeepSpeed's estimators print `{bytes / 2**30:.2f}GB` (GiB, labelled GB): every published figure is rounded to two
# decimals of a GiB, so each row is compared as printed. Rows: (per CPU, per GPU, offload, zero_init).
ZERO3_ROWS = ["offload_param=cpu, zero_init=1", "offload_param=cpu, zero_init=0", "offload_optimizer=cpu, zero_init=1",
              "offload_optimizer=cpu, zero_init=0", "none, zero_init=1", "none, zero_init=0"]  # fmt: skip
ZERO3_OPTIONS = [("optimizer+params", True), ("optimizer+params", False), ("optimizer", True), ("optimizer", False),
                 ("none", True), ("none", False)]  # fmt: skip


def _t5_params(d_model: int, d_ff: int, layers: int, heads: int, d_kv: int, vocab: int, gated: bool) -> tuple[int, int]:
    """(parameters, largest module's parameters) of a HF T5Model (no LM head), as DeepSpeed's model_to_params
    counts them: the embedding is shared by encoder and decoder and is the largest module."""
    ff = (3 if gated else 2) * d_model * d_ff
    attention = 4 * d_model * heads * d_kv
    relative_bias = 32 * heads  # 32 buckets per head, in the first block of each stack
    encoder = layers * (attention + ff + 2 * d_model) + relative_bias + d_model
    decoder = layers * (2 * attention + ff + 3 * d_model) + relative_bias + d_model
    embedding = vocab * d_model
    return embedding + encoder + decoder, embedding


# bigscience/T0_3B is T5 v1.1 XL: d_model 2048, d_ff 5120, 24 layers, 32 heads x 64, gated GeLU, vocab 32128.
T0_3B = _t5_params(2048, 5120, 24, 32, 64, 32128, gated=True)
# t5-3b: d_model 1024, d_ff 16384, 24 layers, 32 heads x 128, ReLU, vocab 32128.
T5_3B = _t5_params(1024, 16384, 24, 32, 128, 32128, gated=False)


def _printed(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


@pytest.mark.parametrize(
    ("gpus", "published"),
    [
        # HF transformers docs, DeepSpeed integration, "Memory requirements", T0_3B on 1 GPU.
        (1, [("70.00", "0.25"), ("70.00", "0.25"), ("62.23", "5.43"), ("62.23", "5.43"), ("0.37", "46.91"),
             ("15.56", "46.91")]),
        # The same section as older releases and the translations print it, on 2 GPUs.
        (2, [("70.00", "0.25"), ("70.00", "0.25"), ("62.23", "2.84"), ("62.23", "2.84"), ("0.74", "23.58"),
             ("31.11", "23.58")]),
    ],
)  # fmt: skip
def test_deepspeed_zero3_estimates_for_t0_3b_as_the_transformers_docs_print_them(gpus: int, published: list) -> None:
    params, largest = T0_3B
    assert (params, largest) == (2_783_959_040, 65_798_144)  # printed: "2783M total params, 65M largest layer"
    for row, (offload, zero_init), (cpu, gpu) in zip(ZERO3_ROWS, ZERO3_OPTIONS, published, strict=True):
        est = deepspeed_estimate(params, gpus, 1, 3, offload, largest, zero_init)  # type: ignore[arg-type]
        assert (_printed(est.per_cpu_bytes), _printed(est.per_gpu_bytes)) == (cpu, gpu), row


@pytest.mark.parametrize(
    ("params", "largest", "published"),
    [
        # DeepSpeed docs/code-docs/source/memory.rst, ZeRO3, t5-3b on 1 node x 8 GPUs, the live model...
        (*T5_3B, [("71.71", "0.12"), ("127.48", "0.12"), ("63.74", "0.79"), ("127.48", "0.79"), ("1.47", "6.10"),
                  ("127.48", "6.10")]),
        # ... and the cold call with total_params=2851e6, largest_layer_params=32e6 (both rounded by the docs).
        (2851e6, 32e6, [("71.69", "0.12"), ("127.45", "0.12"), ("63.72", "0.78"), ("127.45", "0.78"),
                        ("1.43", "6.09"), ("127.45", "6.09")]),
    ],
)  # fmt: skip
def test_deepspeed_zero3_estimates_for_t5_3b_on_eight_gpus_as_deepspeed_documents_them(
    params: float, largest: float, published: list
) -> None:
    assert T5_3B == (2_851_598_336, 32_899_072)  # printed: "2851M total params, 32M largest layer params"
    for row, (offload, zero_init), (cpu, gpu) in zip(ZERO3_ROWS, ZERO3_OPTIONS, published, strict=True):
        est = deepspeed_estimate(params, 8, 1, 3, offload, largest, zero_init)  # type: ignore[arg-type]
        assert (_printed(est.per_cpu_bytes), _printed(est.per_gpu_bytes)) == (cpu, gpu), row


@pytest.mark.parametrize("params", [T5_3B[0], 2851e6])
def test_deepspeed_zero2_estimates_for_t5_3b_on_eight_gpus_and_the_row_printed_before_a_fix(params: float) -> None:
    # memory.rst, ZeRO2: 127.48 (live) / 127.45 (cold) GB per CPU either way, 5.31 GB per GPU with offload_optimizer.
    live = params == T5_3B[0]
    cpu = "127.48" if live else "127.45"
    offloaded = deepspeed_estimate(params, 8, 1, 2, "optimizer")
    assert (_printed(offloaded.per_cpu_bytes), _printed(offloaded.per_gpu_bytes)) == (cpu, "5.31")
    on_gpu = deepspeed_estimate(params, 8, 1, 2, "none")
    assert _printed(on_gpu.per_cpu_bytes) == cpu
    # Its 15.93 GB per GPU without offload was printed by the formula before DeepSpeed PR #5099 (June 2024),
    # 4 P + 16 P / GPUs; the estimator now counts 2 P + 18 P / GPUs (16-bit weights; 16-bit and fp32 gradient
    # partitions, fp32 master and moments), which is what `deepspeed_estimate` follows.
    assert _printed(int(4 * params + 16 * params / 8)) == "15.93"
    assert _printed(on_gpu.per_gpu_bytes) == ("11.29" if live else "11.28")


def _deepspeed_source(params: float, largest: float, per_node: int, nodes: int, zero: int, offload: str,
                      zero_init: bool) -> tuple[int, int]:  # fmt: skip
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs (master, 2025-02), restated: (cpu, gpu); ZeRO-2
    offloads only the optimizer."""
    gpus, buffer = per_node * nodes, 1.5
    if zero == 2:
        if offload != "none":
            return int(params * max(4 * gpus, 16) * buffer), int(2 * params)
        return int(params * 4 * per_node * buffer), int(2 * params + int(18 * params / gpus))
    layer = 4 * largest
    if offload == "optimizer+params":
        factor = 18 / nodes if zero_init else max(4 * per_node, 18 / nodes)
        return int(params * factor * buffer), int(layer)
    if offload == "optimizer":
        factor = 16 / nodes if zero_init else max(4 * per_node, 16 / nodes)
        return int(params * factor * buffer), int(layer + int(2 * params / gpus))
    cpu = (largest if zero_init else params) * 4 * per_node * buffer
    return int(cpu), int(layer + int(18 * params / gpus))


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+params"])
@pytest.mark.parametrize(("per_node", "nodes"), [(1, 1), (8, 1), (8, 4), (4, 16)])
@pytest.mark.parametrize("zero_init", [True, False])
def test_deepspeed_estimate_follows_the_estimators_formulas_on_any_job(
    zero: int, offload: str, per_node: int, nodes: int, zero_init: bool
) -> None:
    params, largest = 70.6e9, 1.05e9
    est = deepspeed_estimate(params, per_node, nodes, zero, offload, largest, zero_init)  # type: ignore[arg-type]
    cpu, gpu = _deepspeed_source(params, largest, per_node, nodes, zero, offload, zero_init)
    assert est.per_cpu_bytes == pytest.approx(cpu, abs=2) and est.per_gpu_bytes == pytest.approx(gpu, abs=2)
