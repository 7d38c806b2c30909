"""FLOPs per token and per step, step time from the accelerator's peak and an MFU, training time for a token budget.

Counting follows Narayanan et al. 2021 (appendix): a token costs 2 FLOPs per matmul weight it passes through in
the forward pass plus 4sh per block for the attention scores and their use (no causal discount), the backward
pass twice the forward, and activation recompute one more forward of what it recomputes (the blocks for `full`,
the attention core for `selective`). The output layer is never recomputed. MoE tokens pass through top_k experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.capacity.memory import Recompute
from tasks.capacity.params import Architecture, count_params

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs one training token costs."""

    forward: float
    model: float
    hardware: float

    @property
    def recompute(self) -> float:
        """Extra FLOPs of activation recompute."""
        return self.hardware - self.model


def flops_per_token(arch: Architecture, recompute: Recompute = "none") -> TokenFlops:
    """Forward, model (fwd + bwd) and hardware (model + recompute) FLOPs per token."""
    pc = count_params(arch)
    head = pc.head or pc.embedding
    block_matmul = pc.matmul_per_token - head
    attention = 4 * arch.seq_len * arch.n_heads * arch.head_dim * arch.n_layers
    blocks_fwd = 2 * block_matmul + attention
    head_fwd = 2 * head
    forward = blocks_fwd + head_fwd
    model = 3 * forward
    extra = {"none": 0.0, "selective": attention, "full": blocks_fwd}[recompute]
    return TokenFlops(forward=forward, model=model, hardware=model + extra)


def narayanan_training_days(params: float, tokens: float, gpus: int, achieved_flops_per_gpu: float) -> float:
    """Narayanan et al. 2021 eq. 4: end-to-end training time 8TP / (nX) with activation recompute, in days."""
    return 8 * tokens * params / (gpus * achieved_flops_per_gpu) / SECONDS_PER_DAY


@dataclass(frozen=True)
class ComputeTime:
    """Compute of one optimizer step spread evenly over `gpus`."""

    model_flops_per_step: float
    hardware_flops_per_step: float
    seconds: float


def compute_time(
    arch: Architecture,
    recompute: Recompute,
    tokens_per_step: float,
    gpus: int,
    peak_flops: float,
    efficiency: float,
) -> ComputeTime:
    """Seconds of arithmetic per step: hardware FLOPs / (gpus x peak x efficiency)."""
    per_token = flops_per_token(arch, recompute)
    hardware = per_token.hardware * tokens_per_step
    return ComputeTime(
        model_flops_per_step=per_token.model * tokens_per_step,
        hardware_flops_per_step=hardware,
        seconds=hardware / (gpus * peak_flops * efficiency),
    )
