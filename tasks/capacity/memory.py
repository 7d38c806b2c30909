"""Memory per GPU: model states (Rajbhandari et al. 2020), activations (Korthikanti et al. 2022), buffers, peak.

Activations come from an inventory of the tensors autograd keeps for backward, per block and per token, split into
what tensor parallelism divides (attention and MLP internals), what it replicates unless sequence parallelism is on
(norms, residual, the input of the column-parallel projections, dropout masks) and what grows with the sequence
(the attention score matrices of non-fused attention). For a GPT block in Megatron-LM (fused LayerNorm, math
attention, dropout, GeLU 4h MLP, 2-byte activations) the inventory adds up to Korthikanti's 34 + 5as/h bytes per
(s, b, h) element; for the payload's model it matches the bytes torch's memory tracker records for a training step.

The peak is the largest of a few moments of a training step: the start of backward (every activation alive plus the
cross-entropy gradients), the backward of the top and of the bottom block (activations freed as gradients appear;
under FSDP also the end of a block's backward, before its gradients are reduce-scattered), and the optimizer step
(every gradient plus the optimizer's temporaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tasks.capacity.params import Architecture, ParamCount, count_params
from tasks.capacity.units import GIB
from training.layout import Layout, Recompute

if TYPE_CHECKING:
    from tasks.capacity.teacher import TeacherLoad

Recipe = Literal["fp32", "autocast", "master-weights", "pure-16bit"]
Optimizer = Literal["adamw", "sgd-momentum", "adafactor", "adam-8bit"]
Offload = Literal["none", "optimizer", "optimizer+params"]


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state and per element of each kind of saved activation.

    - fp32: everything in fp32; AdamW keeps two fp32 moments.
    - autocast: torch.autocast in bf16/fp16 over fp32 parameters (the payload): fp32 weights, gradients and
      moments; matmul outputs in 16 bits, residual stream and norms in fp32; every forward keeps a 16-bit copy of
      each weight it multiplies until that layer's backward.
    - master-weights: 16-bit weights and gradients, fp32 master weights and moments in the optimizer (ZeRO paper,
      Megatron-LM, DeepSpeed): K = 12 bytes of optimizer state per parameter with AdamW, 2 + 2 + 12 = 16 in all;
      with fp32 gradients (Megatron's --accumulate-allreduce-grads-in-fp32 and its main_grad) 2 + 4 + 12 = 18.
    - pure-16bit: 16-bit weights, gradients and optimizer states, no fp32 master: 2 + 2 + 4 = 8 with AdamW.

    `optimizer_bytes` is all the optimizer keeps per parameter: its states (`optimizer_state_bytes`) plus the fp32
    master copy (`master_bytes`) where the recipe has one.
    """

    recipe: Recipe
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: float
    act_bytes: int
    residual_bytes: int
    normed_bytes: int
    optimizer: Optimizer = "adamw"
    master_bytes: int = 0

    @property
    def weight_copy_bytes(self) -> int:
        """Bytes per parameter of the 16-bit weight copies that autocast keeps for backward."""
        return 2 if self.recipe == "autocast" else 0

    @property
    def compute_dtype(self) -> str:
        """The dtype matmuls run in."""
        return "fp32" if self.recipe == "fp32" else "bf16"

    @property
    def step_grad_bytes(self) -> int:
        """Bytes per parameter of the gradient an offloaded optimizer step reads: fp32 beside fp32 weights or an
        fp32 master (DeepSpeed's CPU Adam converts them), else the gradients' own."""
        return self.grad_bytes if self.recipe == "pure-16bit" else 4

    @classmethod
    def of(
        cls,
        dtype: str,
        recipe: Literal["autocast", "master-weights", "pure-16bit"] = "autocast",
        optimizer: Optimizer = "adamw",
        grad_dtype: Literal["fp32"] | None = None,
        arch: Architecture | None = None,
    ) -> Precision:
        """The precision of a `precision.dtype` (fp32, bf16, fp16) under a mixed-precision recipe, an optimizer and
        a gradient dtype (None: the weights'). Under dtype fp32 every recipe trains in fp32. adafactor and adam-8bit
        need `arch`: their states depend on the parameter shapes."""
        if dtype == "fp32":
            return cls("fp32", 4, 4, optimizer_state_bytes(optimizer, arch), 4, 4, 4, optimizer)
        if recipe == "autocast":
            return cls("autocast", 4, 4, optimizer_state_bytes(optimizer, arch), 2, 4, 4, optimizer)
        grads = 4 if grad_dtype == "fp32" else 2
        if recipe == "pure-16bit":
            states = optimizer_state_bytes(optimizer, arch, state_bytes=2)
            return cls("pure-16bit", 2, grads, states, 2, 2, 2, optimizer)
        states = optimizer_state_bytes(optimizer, arch)
        return cls("master-weights", 2, grads, 4 + states, 2, 2, 2, optimizer, master_bytes=4)


ADAM_8BIT_BLOCK = 256
"""Values per fp32 absmax of bitsandbytes' block-wise 8-bit states: 256 since bitsandbytes 0.44 (2024, PR #1365);
2048 in Dettmers et al. 2022 and the releases before."""
ADAM_8BIT_MIN_NUMEL = 4096
"""bitsandbytes' min_8bit_size: tensors with fewer elements keep fp32 states."""


def param_shapes(arch: Architecture) -> list[tuple[tuple[int, ...], int]]:
    """Every parameter tensor of `arch` as (shape, how many): the tensors `count_params` adds up."""
    h, f, kv, layers = arch.d_model, arch.ffn_hidden, arch.kv_dim, arch.n_layers
    norm = 2 if arch.norm == "layernorm" else 1  # weight (and bias) of one norm
    ups = 2 if arch.mlp == "swiglu" else 1
    block: list[tuple[tuple[int, ...], int]] = [((h, h), 2), ((kv, h), 2), ((h,), 2 * norm)]
    mlp: list[tuple[tuple[int, ...], int]] = [((f, h), ups), ((h, f), 1)]
    if arch.bias:
        block += [((h,), 2), ((kv,), 2)]
        mlp += [((f,), ups), ((h,), 1)]
    if arch.n_experts:
        block += [((arch.n_experts, h), 1), *((shape, n * arch.n_experts) for shape, n in mlp)]
    else:
        block += mlp
    tensors: list[tuple[tuple[int, ...], int]] = [((arch.vocab_size, h), 1)]
    if arch.patch_inputs is not None:  # a ViT: the patch embedding's weight and bias, the class token
        tensors = [((h, arch.patch_inputs), 1), ((h,), 1), *([((1, h), 1)] if arch.class_token else [])]
    if arch.positions == "learned":
        tensors.append(((arch.seq_len, h), 1))
    tensors += [(shape, n * layers) for shape, n in block]
    tensors.append(((h,), norm))
    if not arch.tie_embeddings:
        tensors.append(((arch.vocab_size, h), 1))
        if arch.bias:
            tensors.append(((arch.vocab_size,), 1))
    if arch.encoder is not None:  # a vlm: the encoder (no final norm) and the projector
        d, p = arch.encoder.d_model, arch.projector_hidden
        encoder = [(shape, n) for shape, n in param_shapes(arch.encoder) if math.prod(shape) > 0]
        encoder.remove(((d,), 2))  # the final LayerNorm training/vlm.py drops
        tensors += [*encoder, ((p, d), 1), ((p,), 1), ((h, p), 1), ((h,), 1)]
    return tensors


def _adam_8bit_bytes(numel: int, block: int) -> float:
    """Bytes of bitsandbytes' Adam8bit state for one tensor: two uint8 moments and their fp32 absmax per block."""
    if numel < ADAM_8BIT_MIN_NUMEL:
        return 8.0 * numel
    return 2.0 * (numel + 4 * math.ceil(numel / block))


def optimizer_state_bytes(
    optimizer: Optimizer, arch: Architecture | None = None, state_bytes: int = 4, block: int = ADAM_8BIT_BLOCK
) -> float:
    """Bytes of optimizer state per parameter, with full-size states of `state_bytes` bytes per value.

    - adamw: two moments (Loshchilov & Hutter 2019; torch.optim.AdamW's exp_avg and exp_avg_sq).
    - sgd-momentum: one momentum buffer (torch.optim.SGD's momentum_buffer).
    - adafactor: the factored second moment of Shazeer & Stern 2018 (arXiv:1804.04235): r + c values for an (r, c)
      matrix instead of r * c, a full one for 1-D parameters, and no first moment (beta1=None, the paper's
      recommendation and HF transformers' Adafactor default).
    - adam-8bit: bitsandbytes' Adam8bit, block-wise quantization of Dettmers et al. 2022 (arXiv:2110.02861): two
      1-byte moments plus one fp32 absmax per `block` values of each; tensors under 4096 elements keep two fp32
      moments whatever `state_bytes` says.

    adafactor and adam-8bit are averaged over `arch`'s tensors; every rank's share gets that average (sharding
    and tensor parallelism change the shapes, and so Adafactor's r + c, only a little).
    """
    if optimizer == "adamw":
        return 2 * state_bytes
    if optimizer == "sgd-momentum":
        return state_bytes
    assert arch is not None, f"{optimizer}'s states depend on the parameter shapes: pass the architecture"
    tensors = param_shapes(arch)
    total = sum(math.prod(shape) * n for shape, n in tensors)
    if optimizer == "adafactor":
        values = sum((sum(shape) if len(shape) == 2 else math.prod(shape)) * n for shape, n in tensors)
        return values * state_bytes / total
    return sum(_adam_8bit_bytes(math.prod(shape), block) * n for shape, n in tensors) / total


@dataclass(frozen=True)
class Runtime:
    """What the estimate assumes about the software stack.

    `attention`: flash (fused SDPA: keeps q, k, v, output and the log-sum-exp) or math (keeps the score matrices).
    `device`: on CPU torch's autocast runs SDPA in fp32 and copies its output before the output projection;
    on GPUs SDPA runs in 16 bits and its output feeds the projection without a copy.
    `fsdp_root_unsharded`: FSDP2 keeps the root module's parameters (embedding, final norm, output layer)
    gathered from the forward until the end of backward.
    `fsdp_accumulate_unsharded`: with gradient accumulation the payload turns FSDP2's gradient sync off on all but
    the last micro-batch, so full unsharded gradients accumulate (DeepSpeed reduce-scatters every micro-batch).
    """

    attention: Literal["flash", "math"] = "flash"
    device: Literal["gpu", "cpu"] = "gpu"
    ddp_buckets: bool = True
    fsdp_root_unsharded: bool = True
    fsdp_accumulate_unsharded: bool = True
    foreach_optimizer: bool = True


# ---- model states ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageParams:
    """Parameters on one rank of a pipeline stage: its blocks, the embedding on the first, the output layer on the last.

    `dense_*` are divided by tensor parallelism only, `expert_*` by tensor and expert parallelism.
    """

    dense_layer: float
    expert_layer: float
    embed: float
    head: float
    dense: float
    expert: float

    @property
    def layer(self) -> float:
        """Parameters of one block on this rank."""
        return self.dense_layer + self.expert_layer

    @property
    def total(self) -> float:
        """Parameters of the whole stage on this rank."""
        return self.dense + self.expert


def stage_params(
    arch: Architecture, pc: ParamCount, lo: Layout, first: bool, last: bool, layers: float | None = None
) -> StageParams:
    """What one rank of a stage of `lo` with `layers` blocks (None: an even share) holds before ZeRO sharding;
    the embedding is on the first stage, the final norm and output layer on the last."""
    layer_split = pc.per_layer - pc.per_layer_experts - pc.per_layer_norms  # divided by TP
    dense_layer = layer_split / lo.tp + pc.per_layer_norms
    expert_layer = pc.per_layer_experts / (lo.tp * lo.ep)
    embed = (pc.embedding + pc.positions + pc.encoder) / lo.tp if first else 0.0  # a vlm's encoder runs first
    head = ((pc.head or (0 if first else pc.embedding)) / lo.tp + pc.final_norm) if last else 0.0
    layers = arch.n_layers / lo.pp if layers is None else layers
    return StageParams(
        dense_layer=dense_layer,
        expert_layer=expert_layer,
        embed=embed,
        head=head,
        dense=layers * dense_layer + embed + head,
        expert=layers * expert_layer,
    )


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class ModelStates:
    """Bytes of weights, gradients and optimizer states on one rank's device and, offloaded, in its host memory;
    `optimizer_params` are the parameters whose optimizer step runs on the device (none when it is offloaded)."""

    weights: float
    gradients: float
    optimizer: float
    optimizer_params: float
    host_weights: float = 0.0
    host_gradients: float = 0.0
    host_optimizer: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the three on the device."""
        return self.weights + self.gradients + self.optimizer

    @property
    def host(self) -> float:
        """Bytes offloaded to the rank's host memory."""
        return self.host_weights + self.host_gradients + self.host_optimizer


def model_states(params: StageParams, precision: Precision, lo: Layout, offload: Offload = "none") -> ModelStates:
    """Per-rank model states at ZeRO stage `lo.zero` (Rajbhandari et al. 2020): 1 shards the optimizer states,
    2 also the gradients, 3 also the weights, over the shard group; experts over the expert-data-parallel group.

    Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021) moves states to host memory
    where the stage allows it (DeepSpeed: offload_optimizer with ZeRO-1, 2 and 3, offload_param with ZeRO-3 only;
    FSDP2's CPUOffloadPolicy needs fully_shard). `optimizer`: the rank's optimizer states, the fp32 copy of the
    weights its step updates (the master, or a copy of fp32 or pure 16-bit weights) and its gradient partition as
    the step reads it leave the device, and the step runs on the host; ZeRO-1 still holds its unsharded gradients on
    the device until they are reduced. `optimizer+params` at ZeRO-3 moves the weight shards too (gathered to the
    device block by block, counted in the buffers). Other stages keep their states on the device.
    """
    zero, shard = lo.zero, lo.shard * lo.cp
    expert_shard = max(1, shard // lo.ep) if zero else 1
    if zero >= 3:
        weights = (params.dense / shard + params.expert / expert_shard) * precision.weight_bytes
    else:
        weights = params.total * precision.weight_bytes
    optim = params.dense / (shard if zero >= 1 else 1) + params.expert / (expert_shard if zero >= 1 else 1)
    grad_div = shard if zero >= 2 else 1
    grads = (params.dense / grad_div + params.expert / (expert_shard if zero >= 2 else 1)) * precision.grad_bytes
    optimizer = optim * precision.optimizer_bytes
    if offload == "none" or zero == 0:
        return ModelStates(weights=weights, gradients=grads, optimizer=optimizer, optimizer_params=optim)
    params_off = offload == "optimizer+params" and zero >= 3
    # Without a master the host step needs its own copy of the weights it updates, unless they are offloaded.
    own_copy = 0.0 if precision.master_bytes else optim * precision.weight_bytes
    return ModelStates(
        weights=0.0 if params_off else weights,
        gradients=0.0 if zero >= 2 else grads,
        optimizer=0.0,
        optimizer_params=0.0,
        host_weights=weights if params_off else own_copy,
        host_gradients=optim * precision.step_grad_bytes,
        host_optimizer=optimizer,
    )


# ---- activations -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActivations:
    """Saved bytes of one block for one micro-batch, as coefficients.

    bytes = tokens * (split / tp + replicated / (tp if sp else 1) + seq_split * seq / tp)

    `seq` is the tokens of a sequence one rank holds (a context-parallel rank holds 1/cp of it).
    """

    replicated: float
    split: float
    seq_split: float = 0.0

    def bytes(self, micro_batch: int, seq: int, tp: int, sp: bool) -> float:
        """Bytes for a micro-batch of `micro_batch` sequences of `seq` tokens."""
        tokens = micro_batch * seq
        rep = self.replicated / tp if sp else self.replicated
        return tokens * (rep + self.split / tp + self.seq_split * seq / tp)


def _norm_saved(arch: Architecture, p: Precision, consumers: int) -> tuple[float, float]:
    """(bytes per element of h, extra bytes per token) that a pre-norm and the `consumers` linears after it keep."""
    if arch.norm_impl == "fused":
        return p.residual_bytes + p.act_bytes, 0.0  # the norm's input and its output (the next linears' input)
    if arch.norm_impl == "native":
        # nn.LayerNorm keeps its input and an fp32 mean and rstd per token; its output is the linears' input (under
        # autocast in fp32 and kept only as each linear's own 16-bit cast).
        if p.recipe == "autocast":
            return 4 + 2 * consumers, 8.0
        return p.residual_bytes + p.act_bytes, 8.0
    # Eager RMSNorm: x.float() and the normalised fp32 output are kept by the multiplications, plus the rsqrt (one
    # fp32 per token). Under autocast every linear casts the fp32 norm output to 16 bits itself and keeps its copy.
    if p.recipe == "fp32":
        return 4 + 4 + 4, 4.0
    if p.recipe == "autocast":
        return 4 + 4 + 2 * consumers, 4.0
    return 4 + 2 + 2, 4.0


def _mlp_consumers(arch: Architecture, p: Precision) -> int:
    """Linears that read the MLP's norm output (each keeps its own cast under autocast)."""
    if arch.is_moe:
        return 1  # the router; the experts read gathered copies
    return 2 if arch.mlp == "swiglu" else 1


def layer_activations(arch: Architecture, p: Precision, rt: Runtime, recompute: Recompute) -> LayerActivations:
    """Per-token inventory of what one block keeps for backward under `recompute`."""
    h, kv, heads = arch.d_model, arch.kv_dim, arch.n_heads
    if recompute == "full":
        # Only the block's input survives; the rest is recomputed in backward.
        return LayerActivations(replicated=p.residual_bytes * h, split=0.0)
    e = p.act_bytes
    attn_h, attn_tok = _norm_saved(arch, p, consumers=1 if arch.norm_impl == "fused" else 3)
    mlp_h, mlp_tok = _norm_saved(arch, p, consumers=_mlp_consumers(arch, p))
    replicated = attn_h * h + attn_tok + mlp_h * h + mlp_tok
    if arch.dropout:
        replicated += 2 * h  # 1-byte masks after attention and after the MLP
    split = 0.0
    seq_split = 0.0
    if rt.attention == "flash":
        split += (h + 2 * kv) * e  # q, k, v as SDPA keeps them
        out = h * e + heads * 4  # output and fp32 log-sum-exp
        # The CPU kernel writes its output in the query's layout: after rotary embeddings q is (B, H, T, D) and the
        # output is copied to (B, T, H*D) for the projection; without them (a ViT) q is a transposed view and the
        # projection's input is a view of the output, as on a GPU.
        cpu_copy = rt.device == "cpu" and arch.positions == "rope"
        if recompute == "selective":
            # The output is recomputed; where the projection's input is a view of it, that keeps it alive.
            out = 0.0 if cpu_copy else h * e
        split += out
        if cpu_copy:
            split += h * e
    else:
        split += (h + kv) * e + kv * e + h * e  # q, k for the scores; v; the context into the projection
        if recompute != "selective":
            seq_split += heads * e  # softmax output
            if arch.dropout:
                seq_split += heads * (1 + e)  # dropout mask and dropout output
    if arch.is_moe:
        assert arch.n_experts is not None
        k = arch.top_k
        lin_in = 4 if p.recipe == "fp32" else 2
        inner = _mlp_inner(arch, p)
        # router softmax (fp32), top-k indices, normalised weights; per routed copy: its input, the expert's inner
        # activations, its output and the weighted contribution (kept for the weighting and the scatter-add),
        # its index and weight.
        consumers = 2 if arch.mlp == "swiglu" and p.recipe == "autocast" else 1
        split += arch.n_experts * 4 + k * 8 + k * 4 + 4
        split += k * (h * lin_in * consumers + inner + h * e + h * p.residual_bytes + 8 + 4)
    else:
        split += _mlp_inner(arch, p)
    if p.recipe == "autocast" and arch.positions == "rope":
        split += 4 * (arch.head_dim // 2) * e  # 16-bit cos/sin copies for q and k, per position the rank holds
    return LayerActivations(replicated=replicated, split=split, seq_split=seq_split)


def _mlp_inner(arch: Architecture, p: Precision) -> float:
    """Bytes per token kept inside one (expert) MLP: SwiGLU w1 x, silu, w3 x, product; GeLU input and output."""
    return (4 if arch.mlp == "swiglu" else 2) * arch.ffn_hidden * p.act_bytes


def kv_cache_bytes(arch: Architecture, batch: int, context: int, bytes_per_element: int = 2, tp: int = 1) -> float:
    """Inference KV cache: keys and values of every layer for `batch` sequences of `context` tokens."""
    return 2 * arch.n_layers * arch.kv_dim * context * batch * bytes_per_element / tp


# ---- the whole picture -------------------------------------------------------------------------------------------


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class MemoryBreakdown:
    """Peak memory of the most loaded rank, by component, in bytes."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    weight_copies: float
    buffers: float
    transient: float
    margin: float
    phase: str
    stage: str
    states: ModelStates
    stage_index: int = 0
    stage_layers: int = 0
    activations_stored: float = 0.0
    """Every activation the stage saves for backward, at the start of its first backward (all micro-batches in
    flight, autocast's weight copies apart): the stored total; `activations` is what is alive at the peak moment."""
    teacher_weights: float = 0.0
    """distill: the frozen teacher's weights, whole on the rank (tasks/capacity/teacher.py)."""
    teacher_logits: float = 0.0
    """distill: the teacher's logits of one micro-batch, kept for the KL term."""
    teacher_forward: float = 0.0
    """distill: the teacher forward's transient working set (part of `transient` when the peak is its forward)."""

    @property
    def allocated_peak(self) -> float:
        """Peak of tensor memory (what torch.cuda.max_memory_allocated reports)."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.weight_copies
            + self.buffers
            + self.transient
            + self.teacher_weights
            + self.teacher_logits
        )

    @property
    def total(self) -> float:
        """Peak plus the fragmentation and framework margin: what the device must hold."""
        return self.allocated_peak + self.margin

    @property
    def host_bytes(self) -> float:
        """Model states offloaded to the rank's host memory (not part of `total`)."""
        return self.states.host

    def as_dict(self) -> dict[str, float | str]:
        """Bytes per component (for plan.json)."""
        return {
            "weights_bytes": self.weights,
            "gradients_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "activations_stored_bytes": self.activations_stored,
            "autocast_weight_copies_bytes": self.weight_copies,
            "buffers_bytes": self.buffers,
            "transient_bytes": self.transient,
            "teacher_weights_bytes": self.teacher_weights,
            "teacher_logits_bytes": self.teacher_logits,
            "teacher_forward_bytes": self.teacher_forward,
            "allocated_peak_bytes": self.allocated_peak,
            "margin_bytes": self.margin,
            "total_bytes": self.total,
            "host_bytes": self.host_bytes,
            "peak_phase": self.phase,
            "peak_stage": self.stage,
        }


# ---- the parts of a stage's peak ---------------------------------------------------------------------------------


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class StageActivations:
    """Saved activations of one pipeline stage on one rank, in bytes, and what a block's backward changes."""

    in_flight: float  # micro-batches whose activations the stage holds
    layers: float  # blocks in the stage
    tokens: int  # tokens of one micro-batch
    full_recompute: bool
    per_layer: float  # saved tensors of one block for one micro-batch
    copies_per_layer: float  # autocast's 16-bit weight copies of one block
    resting: float  # one block, one micro-batch, between passes
    head_saved: float  # the final norm's and the output layer's saved tensors (last stage)
    head_copies: float  # the output layer's autocast weight copy (last stage)
    live: float  # everything saved at the start of backward
    working: float  # the change while a block's backward runs: recomputed tensors less what is freed
    layer_transient: float  # gradients inside a block's backward


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class StageBuffers:
    """Bytes outside model states and activations: rope tables, DDP buckets, FSDP's root and gathered blocks."""

    resident: float  # alive through the whole step
    gathered: float  # FSDP: blocks gathered while backward runs (only counted at moments inside backward)


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class BackwardGradients:
    """Gradients alive during backward, in bytes, and the divisor ZeRO applies to a stage's gradients."""

    resident: float  # accumulated over micro-batches (or pipeline stages) until the optimizer step
    head: float  # the output layer's
    down_proj: float  # one block's MLP down projection (the first gradient its backward produces)
    divisor: int


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class Moment:
    """One candidate peak of a training step: what is alive then, in bytes."""

    phase: str
    live: float  # saved tensors (weight copies included)
    gradients: float
    transient: float
    gathered: float
    weight_copies: float  # the part of `live` that is autocast weight copies (capped at `live`)

    @property
    def total(self) -> float:
        """What the moment adds to the model states and resident buffers."""
        return self.live + self.gradients + self.transient + self.gathered


@dataclass(frozen=True)
class Margin:
    """Memory the allocator and the framework take beyond live tensors."""

    fragmentation_fraction: float = 0.05
    framework_bytes: float = 1.0 * GIB


def _per_tensor_adamw_temporaries(arch: Architecture, pc: ParamCount) -> float:
    """Peak fp32 temporaries of torch's per-tensor AdamW (CPU default): sqrt(v) and the denominator of a tensor
    while the previous tensor's denominator is still referenced, over the matrices in registration order."""
    h, f, kv = arch.d_model, arch.ffn_hidden, arch.kv_dim
    mlp = [h * f] * (3 if arch.mlp == "swiglu" else 2)
    if arch.is_moe:
        assert arch.n_experts is not None
        mlp = [h * arch.n_experts] + mlp * arch.n_experts
    block = [h * h, h * kv, h * kv, h * h, *mlp]
    sizes = [pc.embedding, *block, *(block if arch.n_layers > 1 else []), *([pc.head] if pc.head else [])]
    return 4.0 * max(2 * cur + prev for prev, cur in zip([0, *sizes[:-1]], sizes, strict=True))


def micro_batches_in_flight(lo: Layout, index: int) -> float:
    """Micro-batches whose activations pipeline stage `index` holds at the start of its first backward, in units
    of the whole stage's layers.

    1F1B: p - index (Korthikanti et al. 2022, section 4.2.3: the first stage holds p). Interleaved over v chunks:
    the schedule's warm-up runs 2(p - index - 1) + (v - 1)p chunk forwards before the first backward (Narayanan
    et al. 2021, Megatron-LM's and torch's interleaved 1F1B), plus the one in flight, each 1/v of the stage; for
    the first stage that is p(1 + (p-1)/(pv)), Korthikanti's figure. GPipe runs every forward before the first
    backward. Never more than the step's micro-batches.
    """
    if lo.pp == 1:
        return 1.0
    m = float(lo.grad_accum)
    if lo.pp_schedule == "gpipe":
        return m
    if lo.pp_schedule == "interleaved-1f1b" and lo.virtual_stages > 1:
        v = lo.virtual_stages
        return min(m, (2 * (lo.pp - index - 1) + (v - 1) * lo.pp + 1) / v)
    return min(m, float(lo.pp - index))


def candidate_stages(lo: Layout, n_layers: int) -> list[int]:
    """The pipeline stages that can hold the peak: the first, the last, and of the middle stages with the same
    number of layers the earliest (the same parameters, and at least as many micro-batches in flight); a middle
    stage with no more layers than the first holds less than it (no embedding, fewer micro-batches in flight)."""
    if lo.pp == 1:
        return [0]
    per_stage = lo.stage_layers(n_layers)
    seen: set[int] = set()
    middle = []
    for index, layers in enumerate(per_stage[1:-1], start=1):
        if layers > per_stage[0] and layers not in seen:
            seen.add(layers)
            middle.append(index)
    return [0, *middle, lo.pp - 1]


def stage_name(index: int, pp: int) -> str:
    """`only`, `first`, `last` or `stage <index>`."""
    if pp == 1:
        return "only"
    return "first" if index == 0 else "last" if index == pp - 1 else f"stage {index}"


class MemoryModel:
    """Memory estimates for one architecture, precision and offload; cheap to evaluate for many layouts."""

    def __init__(
        self,
        arch: Architecture,
        precision: Precision,
        runtime: Runtime | None = None,
        margin: Margin | None = None,
        offload: Offload = "none",
        teacher: TeacherLoad | None = None,
    ) -> None:
        self.arch, self.p, self.rt = arch, precision, runtime or Runtime()
        self.teacher = teacher
        """distill: the frozen teacher every rank holds beside the student (None: no distillation)."""
        self.margin = margin or Margin()
        self.offload: Offload = offload
        self.params: ParamCount = count_params(arch)
        pc = self.params
        self._acts = {r: layer_activations(arch, precision, self.rt, r) for r in ("none", "selective", "full")}
        norm_h, norm_tok = _norm_saved(arch, precision, consumers=1)
        self._head_replicated = norm_h * arch.d_model + norm_tok
        inner = _mlp_inner(arch, precision) / (4 if arch.mlp == "swiglu" else 2)  # bytes per token of one f-vector
        k = arch.top_k if arch.is_moe else 1
        # Inside an MLP's backward: the down projection's input is freed, and up to three (SwiGLU) or two (GeLU)
        # f-sized gradients are alive next to the residual stream's gradient.
        self._mlp_freed = k * inner
        self._mlp_transient = k * inner * (3 if arch.mlp == "swiglu" else 2)
        self._act_cache: dict[tuple[str, int, int, bool, int], float] = {}
        self._shape_cache: dict[tuple[int, int, int, bool, bool], StageParams] = {}
        self._states_cache: dict[tuple[int, int, int, bool, bool, int, int, int], ModelStates] = {}
        self._acts_cache: dict[tuple[object, ...], StageActivations] = {}
        self._per_tensor_opt_transient = _per_tensor_adamw_temporaries(arch, pc)
        self._rope_buffers = 2 * arch.seq_len * (arch.head_dim // 2) * 4 if arch.positions == "rope" else 0

    def _act_bytes(self, recompute: str, micro_batch: int, tp: int, sp: bool, cp: int = 1) -> float:
        """Saved bytes of one block for one micro-batch on one of `cp` context-parallel ranks (its 1/cp of each
        sequence; memoised: the search asks the same few many times)."""
        key = (recompute, micro_batch, tp, sp, cp)
        cached = self._act_cache.get(key)
        if cached is None:
            seq = self.arch.seq_len // cp
            cached = self._act_cache[key] = self._acts[recompute].bytes(micro_batch, seq, tp, sp)
        return cached

    def estimate(self, layout: Layout, limit: float | None = None) -> MemoryBreakdown:
        """Peak memory of the most loaded rank: the pipeline stage of the largest peak (the earliest on a tie).

        Only stages that can be the peak are evaluated: the first, the last, and of the middle stages with the
        same number of layers the earliest (it holds the most micro-batches in flight). With `limit`, the first
        stage found above it is returned at once: a lower bound of the peak, enough to know the layout misses.
        """
        peak: MemoryBreakdown | None = None
        for index in candidate_stages(layout, self.arch.n_layers):
            memory = self._stage(layout, index)
            if peak is None or memory.total > peak.total:
                peak = memory
                if limit is not None and peak.total > limit:
                    break
        assert peak is not None
        return peak

    def states_bound(self, lo: Layout) -> float:
        """A lower bound of the peak's total: the first stage's weights and optimizer states on the device (alive
        through the whole step) with their share of the margin. Memoised, so a search can drop layouts whose
        model states alone do not fit before it looks at their activations."""
        layers = lo.stage_layers(self.arch.n_layers)[0] if lo.pp > 1 else self.arch.n_layers
        states = self._states(lo, self._stage_params(lo, True, lo.pp == 1, layers), True, lo.pp == 1, layers)
        resident = states.weights + states.optimizer + (self.teacher.weights_bytes if self.teacher else 0.0)
        return resident * (1 + self.margin.fragmentation_fraction) + self.margin.framework_bytes

    def _states(self, lo: Layout, params: StageParams, first: bool, last: bool, layers: int) -> ModelStates:
        """The stage's model states (memoised: a search meets the same sharding of the same stage many times)."""
        key = (lo.tp, lo.ep, lo.pp, first, last, layers, lo.zero, lo.shard * lo.cp)
        states = self._states_cache.get(key)
        if states is None:
            states = self._states_cache[key] = model_states(params, self.p, lo, self.offload)
        return states

    def stages(self, layout: Layout) -> list[MemoryBreakdown]:
        """Peak memory of every pipeline stage, in order."""
        return [self._stage(layout, index) for index in range(layout.pp)]

    def stage(self, layout: Layout, which: Literal["first", "last"] | int) -> MemoryBreakdown:
        """Peak memory of the first, the last or the `which`-th pipeline stage."""
        index = {"first": 0, "last": layout.pp - 1}[which] if isinstance(which, str) else which
        return self._stage(layout, index)

    def _stage_params(self, lo: Layout, first: bool, last: bool, layers: int) -> StageParams:
        """The stage's parameters on one rank (memoised: they depend on tp, ep, the stage's ends and layers)."""
        key = (lo.tp, lo.ep, lo.pp, first, last, layers)
        params = self._shape_cache.get(key)
        if params is None:
            params = self._shape_cache[key] = stage_params(self.arch, self.params, lo, first, last, layers)
        return params

    def _activations(self, lo: Layout, params: StageParams, index: int, layers: int) -> StageActivations:
        """Saved activations of stage `index` (of `layers` blocks) and what changes while a block's backward runs."""
        arch, p, tp, b = self.arch, self.p, lo.tp, lo.micro_batch
        sp = lo.sequence_parallel and tp > 1
        tokens, last = b * arch.seq_len // lo.cp, index == lo.pp - 1
        in_flight = micro_batches_in_flight(lo, index)
        full = lo.recompute == "full"
        per_layer = self._act_bytes(lo.recompute, b, tp, sp, lo.cp)
        copies_per_layer = (params.layer - self.params.per_layer_norms) * p.weight_copy_bytes
        resting = per_layer + (0.0 if full else copies_per_layer)
        if arch.is_vision:
            # A classifier: the final norm runs on every token (its input, mean and rstd kept), the head on one
            # token per image (its input and the fp32 logits); the patch embedding keeps its pixels (first stage).
            rows = tokens * arch.output_rows_per_sequence / arch.seq_len
            head_saved = (tokens * (p.residual_bytes * arch.d_model + 8) + rows * (arch.d_model * p.act_bytes
                          + 4 * arch.vocab_size / tp)) if last else 0.0  # fmt: skip
            if index == 0:
                assert arch.patch_inputs is not None
                head_saved += tokens * arch.patches / arch.seq_len * arch.patch_inputs * p.act_bytes
        else:
            head_saved = tokens * (self._head_replicated / (tp if sp else 1) + 4 * arch.vocab_size / tp) if last else 0.0
        head_copies = (self.params.head or self.params.embedding) / tp * p.weight_copy_bytes if last else 0.0
        # The block whose backward runs: recomputed in full (its input is already counted), minus what is freed.
        working = -tokens * self._mlp_freed / tp
        if full:
            working += (
                self._act_bytes("none", b, tp, sp, lo.cp) + copies_per_layer - tokens * p.residual_bytes * arch.d_model
            )
        # Context parallel: attention runs on the whole sequence's keys and values, gathered from the cp ranks.
        gathered_kv = 2 * b * arch.seq_len * arch.kv_dim / tp * p.act_bytes if lo.cp > 1 else 0.0
        return StageActivations(
            in_flight=in_flight,
            layers=layers,
            tokens=tokens,
            full_recompute=full,
            per_layer=per_layer,
            copies_per_layer=copies_per_layer,
            resting=resting,
            head_saved=head_saved,
            head_copies=head_copies,
            live=in_flight * layers * resting + head_saved + head_copies,
            working=working,
            layer_transient=tokens * (arch.d_model * p.residual_bytes + self._mlp_transient / tp) + gathered_kv,
        )

    def _buffers(self, lo: Layout, params: StageParams, layers: int) -> StageBuffers:
        """Rope tables, DDP's gradient buckets, FSDP's root and the blocks it gathers during backward."""
        resident = float(self._rope_buffers)
        if lo.zero == 0 and lo.dp * lo.cp > 1 and self.rt.ddp_buckets:
            resident += params.total * self.p.grad_bytes  # DDP's flat gradient buckets
        gathered = 0.0
        if lo.zero >= 3:
            if self.rt.fsdp_root_unsharded:
                resident += (params.embed + params.head) * self.p.weight_bytes  # FSDP2 keeps the root gathered
            # The block in backward and the one prefetched; with full recompute the recomputed forward's own
            # prefetch gathers a third.
            gathered = min(3.0 if lo.recompute == "full" else 2.0, layers) * params.layer * self.p.weight_bytes
        return StageBuffers(resident=resident, gathered=gathered)

    def _backward_gradients(self, lo: Layout, params: StageParams, states: ModelStates) -> BackwardGradients:
        """The gradients alive during backward: accumulated ones, the output layer's and a block's down projection."""
        gb = self.p.grad_bytes
        accumulating = lo.grad_accum > 1 or lo.pp > 1
        resident = states.gradients if accumulating else 0.0
        if accumulating and lo.zero >= 2 and self.rt.fsdp_accumulate_unsharded:
            resident = params.total * gb  # sync off on all but the last micro-batch: unsharded gradients pile up
        divisor = lo.shard * lo.cp if lo.zero >= 2 else 1
        # The output layer's gradient; FSDP2 reduce-scatters the root's gradients only at the end of backward.
        root_unsharded = lo.zero >= 3 and self.rt.fsdp_root_unsharded
        down_proj = self.arch.ffn_hidden * self.arch.d_model / lo.tp * gb
        if self.arch.is_moe:
            down_proj *= self.arch.top_k / lo.ep
        return BackwardGradients(
            resident=resident,
            head=params.head * gb / (1 if root_unsharded else divisor),
            down_proj=down_proj,
            divisor=divisor,
        )

    def _moments(
        self,
        lo: Layout,
        params: StageParams,
        states: ModelStates,
        acts: StageActivations,
        grads: BackwardGradients,
        gathered: float,
        last: bool,
    ) -> Moment:
        """The peak of the candidate moments of a training step (the earliest on a tie). Each candidate is
        (phase, live, gradients, transient, gathered, weight copies); only the peak becomes a Moment (a search
        weighs millions of candidates)."""
        gb, full = self.p.grad_bytes, acts.full_recompute
        copies_live = acts.in_flight * acts.layers * (0.0 if full else acts.copies_per_layer)
        top_live = acts.live - acts.head_saved - acts.head_copies + acts.working
        top_grads = (grads.resident if grads.resident > grads.head else grads.head) + grads.down_proj
        candidates = [
            ("backward, top block", top_live, top_grads, acts.layer_transient, gathered,
             copies_live + acts.copies_per_layer * full),
        ]  # fmt: skip
        if last:
            rows = acts.tokens * self.arch.output_rows_per_sequence / self.arch.seq_len  # one per image for a ViT
            loss_transient = rows * 8 * self.arch.vocab_size / lo.tp  # fp32 gradients of log-probs and logits
            if self.teacher is not None:  # distill: the KL term's saved log-softmaxes and gradients besides
                loss_transient += self.teacher.kl_loss_bytes(acts.tokens)
            candidates.append(
                ("start of backward", acts.live, grads.resident, loss_transient, 0.0, copies_live + acts.head_copies)
            )
        bottom_live = (
            (acts.in_flight - 1) * acts.layers * acts.resting
            + (acts.per_layer if full else acts.resting)
            + acts.working
        )
        rest = params.total - params.layer - params.embed - params.head
        bottom_grads = rest * gb / grads.divisor + grads.head + grads.down_proj
        bottom_grads = grads.resident if grads.resident > bottom_grads else bottom_grads
        candidates.append(
            ("backward, bottom block", bottom_live, bottom_grads, acts.layer_transient, gathered, acts.copies_per_layer)
        )
        if lo.zero >= 3:
            # End of a block's backward under FSDP: its saved tensors are gone, its whole unsharded gradient and
            # the reduce-scatter input copied from it are alive until the reduce-scatter.
            done_live = acts.live - acts.head_saved - acts.head_copies - (acts.per_layer if full else acts.resting)
            candidates.append(
                ("backward, top block (reduce-scatter)", done_live, grads.head + 2 * params.layer * gb,
                 acts.tokens * self.arch.d_model * self.p.residual_bytes, gathered,
                 copies_live + acts.copies_per_layer * full)
            )  # fmt: skip
        if self.rt.foreach_optimizer:
            opt_transient = states.optimizer_params * 4  # torch's foreach AdamW: one fp32 temporary per parameter
        else:
            opt_transient = self._per_tensor_opt_transient / lo.tp
        candidates.append(("optimizer step", 0.0, states.gradients, opt_transient, 0.0, 0.0))
        if last and self.teacher is not None:
            # The teacher's forward runs after the student's (all its activations saved), before its backward.
            candidates.append(("teacher forward", acts.live, grads.resident, self.teacher.forward_bytes(acts.tokens),
                               0.0, copies_live + acts.head_copies))  # fmt: skip
        peak, peak_total = candidates[0], -1.0
        for candidate in candidates:
            total = candidate[1] + candidate[2] + candidate[3] + candidate[4]
            if total > peak_total:
                peak, peak_total = candidate, total
        return Moment(*peak)

    def _stage(self, lo: Layout, index: int) -> MemoryBreakdown:
        """Pipeline stage `index`'s peak: its model states, buffers and the largest of its candidate moments."""
        first, last = index == 0, index == lo.pp - 1
        layers = lo.stage_layers(self.arch.n_layers)[index] if lo.pp > 1 else self.arch.n_layers
        params = self._stage_params(lo, first, last, layers)
        states = self._states(lo, params, first, last, layers)
        akey = (lo.tp, lo.ep, lo.pp, lo.cp, lo.micro_batch, lo.grad_accum, lo.recompute, lo.sequence_parallel,
                lo.pp_schedule, lo.virtual_stages, index, layers)  # fmt: skip
        acts = self._acts_cache.get(akey)
        if acts is None:  # memoised: layouts that differ in sharding only save the same activations
            acts = self._acts_cache[akey] = self._activations(lo, params, index, layers)
        buffers = self._buffers(lo, params, layers)
        grads = self._backward_gradients(lo, params, states)
        peak = self._moments(lo, params, states, acts, grads, buffers.gathered, last)
        copies = min(peak.weight_copies, peak.live)
        buffer_bytes = buffers.resident + peak.gathered
        teacher = self.teacher if last else None  # distill runs data-parallel layouts only: one stage
        teacher_weights = teacher.weights_bytes if teacher else 0.0
        teacher_logits = teacher.logits_bytes(acts.tokens) if teacher else 0.0
        allocated = states.weights + states.optimizer + buffer_bytes + peak.live + peak.gradients + peak.transient
        allocated += teacher_weights + teacher_logits
        return MemoryBreakdown(
            weights=states.weights,
            gradients=peak.gradients,
            optimizer=states.optimizer,
            activations=peak.live - copies,
            weight_copies=copies,
            buffers=buffer_bytes,
            transient=peak.transient,
            margin=allocated * self.margin.fragmentation_fraction + self.margin.framework_bytes,
            phase=peak.phase,
            stage=stage_name(index, lo.pp),
            stage_index=index,
            stage_layers=layers,
            states=states,
            activations_stored=acts.in_flight * acts.layers * acts.per_layer + acts.head_saved,
            teacher_weights=teacher_weights,
            teacher_logits=teacher_logits,
            teacher_forward=teacher.forward_bytes(acts.tokens) if teacher else 0.0,
        )
