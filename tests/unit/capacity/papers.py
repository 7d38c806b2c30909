"""The papers' own formulas, kept as oracles the planner's figures are checked against (not planner code).

- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") Table 2: activation
  bytes of one GPT layer.
- DeepSpeed's estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs: model-state bytes per
  GPU and per node's CPU memory.
- Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters") eq. 4: training days;
  section 3.2: tensor-parallel bytes per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tasks.capacity.compute import budget_time
from tasks.capacity.memory import Offload, Precision, StageParams, model_states
from training.layout import Layout, Recompute


def korthikanti_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int, sp: bool, recompute: Recompute) -> float:
    """Korthikanti et al. 2022 Table 2: activation bytes of one GPT layer (16-bit, dropout, math attention)."""
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    attn_scores = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attn_scores) / tp
    return s * b * h * (10 + 24 / tp + attn_scores / tp)


@dataclass(frozen=True)
class DeepSpeedEstimate:
    """One row of DeepSpeed's ZeRO-2/ZeRO-3 model-state estimators: bytes per GPU and per node's CPU memory."""

    per_gpu_bytes: int
    per_cpu_bytes: int


def deepspeed_estimate(
    total_params: float,
    gpus_per_node: int,
    nodes: int,
    zero: Literal[2, 3],
    offload: Offload,
    largest_layer_params: float = 0,
    zero_init: bool = True,
    buffer_factor: float = 1.5,
) -> DeepSpeedEstimate:
    """What DeepSpeed's estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs return
    (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py), built on `model_states`.

    DeepSpeed's convention is not the planner's. Its mixed precision keeps 16-bit weights, an fp32 gradient
    partition, fp32 master weights and Adam moments (master-weights with grad_dtype fp32: 2 + 4 + 12 = 18 bytes per
    parameter under ZeRO-3); ZeRO-2 without offload also counts the 16-bit gradient partition beside the fp32 one
    (2 bytes more); ZeRO-3 adds 4 bytes per parameter of the largest layer to the GPU (its gathered 16-bit weights
    and gradients; the planner counts gathered blocks as buffers). ZeRO-2 offloads only the optimizer. The CPU
    figure is one node's: `buffer_factor` times the larger of its ranks' offloaded states and the fp32 model each
    process builds before ZeRO partitions it (with zero.Init, ZeRO-3: nothing when offloading, the largest layer
    when not). When it offloads, ZeRO-2's estimator puts every GPU of the job on that CPU, states and fp32 models
    alike (ZeRO-3's counts a node's): kept as DeepSpeed has it. The planner adds no buffer factor or model build.
    """
    gpus = gpus_per_node * nodes
    precision = Precision.of("bf16", "master-weights", grad_dtype="fp32")
    whole = StageParams(dense_layer=0.0, expert_layer=0.0, embed=0.0, head=0.0, dense=float(total_params), expert=0.0)
    states = model_states(whole, precision, Layout(dp=gpus, zero=zero), offload)
    gpu = states.total
    if zero == 2 and offload == "none":
        gpu += 2 * total_params / gpus  # the 16-bit gradient partition
    if zero == 3:
        gpu += 4 * largest_layer_params
    ranks = gpus if zero == 2 and offload != "none" else gpus_per_node
    if offload == "none":
        cpu = 4 * (largest_layer_params if zero == 3 and zero_init else total_params) * gpus_per_node
    else:
        built = 0.0 if zero == 3 and zero_init else 4 * total_params * ranks
        cpu = max(built, states.host * ranks)
    return DeepSpeedEstimate(per_gpu_bytes=int(gpu), per_cpu_bytes=int(cpu * buffer_factor))


def narayanan_training_days(params: float, tokens: float, gpus: int, achieved_flops_per_gpu: float) -> float:
    """Narayanan et al. 2021 eq. 4: end-to-end training time 8TP / (nX) with activation recompute, in days."""
    return budget_time(8 * tokens * params, gpus, achieved_flops_per_gpu, 1.0).days


def narayanan_tp_bytes_per_layer(b: int, s: int, h: int, tp: int, bytes_per_value: int) -> float:
    """Narayanan et al. 2021 section 3.2: each device sends 8bsh(t-1)/t values per layer and micro-batch under
    tensor parallelism (two all-reduces of the (b, s, h) hidden states in forward and two in backward)."""
    return 8 * b * s * h * (tp - 1) / tp * bytes_per_value
