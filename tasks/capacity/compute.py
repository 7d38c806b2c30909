"""FLOPs per token and per step under named conventions, MFU and HFU, step time, time for a FLOP budget.

Model FLOPs follow Narayanan et al. 2021 (appendix, eq. 3 without its recompute pass): a token costs 2 FLOPs per
matmul weight it passes through in the forward pass plus 4sh per block for the attention scores and their use
over the values (no causal discount), and the backward pass twice the forward. Hardware FLOPs add activation
recompute: for `full` one more forward of the blocks (Narayanan et al. 2021 eq. 3), for `selective` the attention
core counted as in Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
Appendix A eq. 8. Their text names one extra forward of QK^T and attention over V (4sh per block per token), but
eq. 8 adds the attention term of eq. 7 again, s/(6h) of 72BsLh^2, that is 12sh per block per token (forward and
backward of the attention core), and their Table 5 HFU and section 5's "2.7% and 1.6% FLOPs overhead" for GPT-3
and MT-NLG follow eq. 8; the planner uses eq. 8 so that its HFU is the one published. The output layer is never
recomputed. MoE tokens pass through top_k experts. A ViT's tokens are image tokens (patches and the class token):
the patch embedding is a matmul on each patch, the classifier one on each image (tasks/capacity/params.py). A
vision-language model's encoder and projector run once per sequence, over its image's patches.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.layout import Recompute
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


def encoder_forward_flops(arch: Architecture) -> float:
    """Forward FLOPs of a vision-language model's encoder and projector for one sequence (its image): 2 per weight
    (and bias) on each image token, 4sh per block for attention, the patch embedding on each patch; 0 without one."""
    enc = arch.encoder
    if enc is None:
        return 0.0
    assert enc.patch_inputs is not None
    pc = count_params(enc)
    attention = 4 * enc.seq_len * enc.n_heads * enc.head_dim
    blocks = enc.seq_len * enc.n_layers * (2 * (pc.per_layer - pc.per_layer_norms) + attention)
    patch = 2 * enc.patch_inputs * enc.d_model * enc.patches
    p = arch.projector_hidden
    projector = 2 * (enc.d_model * p + p + p * arch.d_model + arch.d_model) * enc.patches
    return blocks + patch + projector


def flops_per_token(arch: Architecture, recompute: Recompute = "none") -> TokenFlops:
    """Forward, model (fwd + bwd) and hardware (model + recompute) FLOPs per token."""
    pc = count_params(arch)
    head = pc.head or pc.embedding
    block_matmul = pc.matmul_per_token - head
    # QK^T and attention over V, 2 FLOPs per multiply-add each: 4sh per block in the forward pass.
    attention_fwd = 4 * arch.seq_len * arch.n_heads * arch.head_dim * arch.n_layers
    blocks_fwd = 2 * block_matmul + attention_fwd
    # A vision-language model: the encoder and projector run once per sequence (its image), spread over its tokens.
    blocks_fwd += encoder_forward_flops(arch) / arch.seq_len
    head_fwd = 2 * head
    if arch.patch_inputs is not None:
        # A ViT: the classifier runs on one token per image and the patch embedding (the Conv2d, a matmul of
        # channels x patch^2 inputs) on every patch token; per image token, averaged over the image's tokens.
        head_fwd = 2 * head * arch.output_rows_per_sequence / arch.seq_len
        head_fwd += 2 * arch.patch_inputs * arch.d_model * arch.patches / arch.seq_len
    forward = blocks_fwd + head_fwd
    model = 3 * forward
    # Selective: Korthikanti eq. 8 counts the attention core's forward and backward again (see the module doc).
    extra = {"none": 0.0, "selective": 3 * attention_fwd, "full": blocks_fwd}[recompute]
    return TokenFlops(forward=forward, model=model, hardware=model + extra)


@dataclass(frozen=True)
class Convention:
    """One way of counting training FLOPs: `key` names its field in `FlopsConventions`, `name` and `source` print."""

    key: str
    name: str
    source: str


CONVENTIONS: tuple[Convention, ...] = (
    Convention(
        "six_nd",
        "6ND, all parameters",
        "Hoffmann et al. 2022 (Chinchilla) App. F: 6 x parameters (embeddings included) x tokens; MoE: active ones",
    ),
    Convention(
        "six_nd_non_embedding",
        "6ND, non-embedding parameters",
        "Kaplan et al. 2020 Table 1: C = 6NBS, N without vocabulary and position matrices",
    ),
    Convention(
        "narayanan",
        "model FLOPs",
        "Narayanan et al. 2021 App.: 2 per matmul weight + 4sh per block attention, backward 2x forward",
    ),
    Convention(
        "hardware",
        "hardware FLOPs",
        "model FLOPs + recompute: Narayanan et al. 2021 eq. 3 (full), Korthikanti et al. 2022 eq. 8 (selective)",
    ),
)


@dataclass(frozen=True)
class FlopsConventions:
    """Training FLOPs of `tokens` tokens counted by each of `CONVENTIONS`."""

    tokens: float
    recompute: Recompute
    six_nd: float
    six_nd_non_embedding: float
    narayanan: float
    hardware: float

    def by_convention(self) -> list[tuple[Convention, float]]:
        """Each convention with its FLOPs, in `CONVENTIONS` order, for a plan to print."""
        return [(c, getattr(self, c.key)) for c in CONVENTIONS]


def flops_conventions(arch: Architecture, tokens: float, recompute: Recompute = "none") -> FlopsConventions:
    """FLOPs of training `arch` on `tokens` tokens under each named convention (`tokens=1`: per token)."""
    pc = count_params(arch)
    per_token = flops_per_token(arch, recompute)
    # Tokens pass through top_k experts, so 6N counts what a token uses (equal to the total for a dense model).
    params = pc.active_per_token
    vocabulary = pc.embedding + pc.positions + pc.head
    return FlopsConventions(
        tokens=tokens,
        recompute=recompute,
        six_nd=6 * params * tokens,
        six_nd_non_embedding=6 * (params - vocabulary) * tokens,
        narayanan=per_token.model * tokens,
        hardware=per_token.hardware * tokens,
    )


def flops_utilization(flops: float, seconds: float, gpus: int, peak_flops_per_gpu: float) -> float:
    """Fraction of peak that `flops` done in `seconds` on `gpus` is: MFU for model FLOPs, HFU for hardware FLOPs."""
    return flops / (seconds * gpus * peak_flops_per_gpu)


@dataclass(frozen=True)
class Utilization:
    """Model and hardware FLOPs utilization of a measured step (Chowdhery et al. 2022; Korthikanti et al. 2022)."""

    mfu: float
    hfu: float


def utilization(
    arch: Architecture,
    recompute: Recompute,
    tokens_per_step: float,
    step_seconds: float,
    gpus: int,
    peak_flops_per_gpu: float,
) -> Utilization:
    """MFU and HFU of a step of `tokens_per_step` tokens that took `step_seconds` on `gpus`."""
    per_token = flops_per_token(arch, recompute)
    return Utilization(
        mfu=flops_utilization(per_token.model * tokens_per_step, step_seconds, gpus, peak_flops_per_gpu),
        hfu=flops_utilization(per_token.hardware * tokens_per_step, step_seconds, gpus, peak_flops_per_gpu),
    )


@dataclass(frozen=True)
class BudgetTime:
    """Wall-clock time a FLOP budget takes."""

    seconds: float

    @property
    def days(self) -> float:
        """The same time in days."""
        return self.seconds / SECONDS_PER_DAY


def budget_time(flops: float, gpus: int, peak_flops_per_gpu: float, mfu: float) -> BudgetTime:
    """Time to do `flops` on `gpus` at `mfu` of their peak (the FLOPs in the convention the utilization is of)."""
    return BudgetTime(seconds=flops / (gpus * peak_flops_per_gpu * mfu))


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
        seconds=budget_time(hardware, gpus, peak_flops, efficiency).seconds,
    )
