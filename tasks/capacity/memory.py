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

from dataclasses import dataclass
from typing import Literal

from tasks.capacity.params import Architecture, ParamCount, count_params
from tasks.capacity.units import GIB

Recompute = Literal["none", "selective", "full"]
Recipe = Literal["fp32", "autocast", "master-weights"]


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state and per element of each kind of saved activation.

    - fp32: everything in fp32; AdamW keeps two fp32 moments.
    - autocast: torch.autocast in bf16/fp16 over fp32 parameters (the payload): fp32 weights, gradients and
      moments; matmul outputs in 16 bits, residual stream and norms in fp32; every forward keeps a 16-bit copy of
      each weight it multiplies until that layer's backward.
    - master-weights: 16-bit weights and gradients, fp32 master weights and moments in the optimizer (ZeRO paper,
      Megatron-LM, DeepSpeed): K = 12 bytes of optimizer state per parameter.
    """

    recipe: Recipe
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    act_bytes: int
    residual_bytes: int
    normed_bytes: int

    @property
    def weight_copy_bytes(self) -> int:
        """Bytes per parameter of the 16-bit weight copies that autocast keeps for backward."""
        return 2 if self.recipe == "autocast" else 0

    @property
    def compute_dtype(self) -> str:
        """The dtype matmuls run in."""
        return "fp32" if self.recipe == "fp32" else "bf16"

    @classmethod
    def of(cls, dtype: str, recipe: Literal["autocast", "master-weights"] = "autocast") -> Precision:
        """The precision of a `precision.dtype` (fp32, bf16, fp16) under a mixed-precision recipe."""
        if dtype == "fp32":
            return cls("fp32", 4, 4, 8, 4, 4, 4)
        if recipe == "autocast":
            return cls("autocast", 4, 4, 8, 2, 4, 4)
        return cls("master-weights", 2, 2, 12, 2, 2, 2)


@dataclass(frozen=True)
class Layout:
    """How a job is spread: degrees, sharding, micro-batching and recompute.

    `zero` is the sharding stage over the data-parallel group (0: DDP; 1: optimizer states; 2: + gradients;
    3: + weights, i.e. FSDP). `shard_group` is the number of ranks a ZeRO/FSDP shard spans (hsdp: a node);
    None means the whole data-parallel group. Experts are spread over `ep` ranks of the data-parallel group.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    shard_group: int | None = None
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    pp_schedule: Literal["1f1b", "interleaved", "gpipe"] = "1f1b"
    virtual_stages: int = 1

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.dp * self.tp * self.pp

    @property
    def shard(self) -> int:
        """Ranks one ZeRO/FSDP shard spans."""
        return self.shard_group or self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch * self.grad_accum

    def describe(self) -> str:
        """Short human name, e.g. `dp8 tp2 pp1 zero3 mb4x2 sel sp`."""
        name = f"dp{self.dp} tp{self.tp} pp{self.pp}"
        if self.ep > 1:
            name += f" ep{self.ep}"
        name += f" zero{self.zero}"
        if self.zero and self.shard != self.dp:
            name += f"/{self.shard}"
        name += f" mb{self.micro_batch}x{self.grad_accum} {self.recompute}"
        if self.sequence_parallel:
            name += " sp"
        if self.pp > 1 and self.pp_schedule == "interleaved":
            name += f" v{self.virtual_stages}"
        if self.pp > 1 and self.pp_schedule == "gpipe":
            name += " gpipe"
        return name


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


def stage_params(arch: Architecture, pc: ParamCount, lo: Layout, first: bool, last: bool) -> StageParams:
    """What one rank of the first, last (or only) stage of `lo` holds before any ZeRO sharding."""
    layer_split = pc.per_layer - pc.per_layer_experts - pc.per_layer_norms  # divided by TP
    dense_layer = layer_split / lo.tp + pc.per_layer_norms
    expert_layer = pc.per_layer_experts / (lo.tp * lo.ep)
    embed = (pc.embedding + pc.positions) / lo.tp if first else 0.0
    head = ((pc.head or (0 if first else pc.embedding)) / lo.tp + pc.final_norm) if last else 0.0
    layers = arch.n_layers / lo.pp
    return StageParams(
        dense_layer=dense_layer,
        expert_layer=expert_layer,
        embed=embed,
        head=head,
        dense=layers * dense_layer + embed + head,
        expert=layers * expert_layer,
    )


@dataclass(frozen=True)
class ModelStates:
    """Bytes of weights, gradients and optimizer states on one rank, and the parameters whose states it holds."""

    weights: float
    gradients: float
    optimizer: float
    optimizer_params: float

    @property
    def total(self) -> float:
        """Sum of the three."""
        return self.weights + self.gradients + self.optimizer


def model_states(params: StageParams, precision: Precision, lo: Layout) -> ModelStates:
    """Per-rank model states at ZeRO stage `lo.zero` (Rajbhandari et al. 2020): 1 shards the optimizer states,
    2 also the gradients, 3 also the weights, over the shard group; experts over the expert-data-parallel group."""
    zero, shard = lo.zero, lo.shard
    expert_shard = max(1, shard // lo.ep) if zero else 1
    if zero >= 3:
        weights = (params.dense / shard + params.expert / expert_shard) * precision.weight_bytes
    else:
        weights = params.total * precision.weight_bytes
    optim = params.dense / (shard if zero >= 1 else 1) + params.expert / (expert_shard if zero >= 1 else 1)
    grad_div = shard if zero >= 2 else 1
    grads = (params.dense / grad_div + params.expert / (expert_shard if zero >= 2 else 1)) * precision.grad_bytes
    return ModelStates(
        weights=weights, gradients=grads, optimizer=optim * precision.optimizer_bytes, optimizer_params=optim
    )


# ---- activations -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActivations:
    """Saved bytes of one block for one micro-batch, as coefficients.

    bytes = tokens * (split / tp + replicated / (tp if sp else 1) + per_seq_split * seq / tp) + per_sequence * b
    """

    replicated: float
    split: float
    seq_split: float = 0.0
    per_sequence: float = 0.0

    def bytes(self, micro_batch: int, seq: int, tp: int, sp: bool) -> float:
        """Bytes for a micro-batch of `micro_batch` sequences of `seq` tokens."""
        tokens = micro_batch * seq
        rep = self.replicated / tp if sp else self.replicated
        return tokens * (rep + self.split / tp + self.seq_split * seq / tp) + self.per_sequence * micro_batch / tp


def _norm_saved(arch: Architecture, p: Precision, consumers: int) -> tuple[float, float]:
    """(bytes per element of h, extra bytes per token) that a pre-norm and the `consumers` linears after it keep."""
    if arch.norm_impl == "fused":
        return p.residual_bytes + p.act_bytes, 0.0  # the norm's input and its output (the next linears' input)
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
    attn_h, attn_tok = _norm_saved(arch, p, consumers=3 if arch.norm_impl == "eager" else 1)
    mlp_h, mlp_tok = _norm_saved(arch, p, consumers=_mlp_consumers(arch, p))
    replicated = attn_h * h + attn_tok + mlp_h * h + mlp_tok
    if arch.dropout:
        replicated += 2 * h  # 1-byte masks after attention and after the MLP
    split = 0.0
    seq_split = 0.0
    if rt.attention == "flash":
        split += (h + 2 * kv) * e  # q, k, v as SDPA keeps them
        out = h * e + heads * 4  # output and fp32 log-sum-exp
        if recompute == "selective":
            # The output is recomputed; on a GPU the projection's input is a view of it and keeps it alive.
            out = 0.0 if rt.device == "cpu" else h * e
        split += out
        if rt.device == "cpu":
            split += h * e  # the CPU kernel's (B, H, T, D) output is copied to (B, T, H*D) for the projection
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
    per_sequence = 0.0
    if p.recipe == "autocast" and arch.positions == "rope":
        per_sequence = 4 * arch.seq_len * (arch.head_dim // 2) * e  # 16-bit cos/sin copies for q and k
    return LayerActivations(replicated=replicated, split=split, seq_split=seq_split, per_sequence=per_sequence)


def _mlp_inner(arch: Architecture, p: Precision) -> float:
    """Bytes per token kept inside one (expert) MLP: SwiGLU w1 x, silu, w3 x, product; GeLU input and output."""
    return (4 if arch.mlp == "swiglu" else 2) * arch.ffn_hidden * p.act_bytes


def korthikanti_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int, sp: bool, recompute: Recompute) -> float:
    """Korthikanti et al. 2022 Table 2: activation bytes of one GPT layer (16-bit, dropout, math attention)."""
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    attn_scores = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attn_scores) / tp
    return s * b * h * (10 + 24 / tp + attn_scores / tp)


def kv_cache_bytes(arch: Architecture, batch: int, context: int, bytes_per_element: int = 2, tp: int = 1) -> float:
    """Inference KV cache: keys and values of every layer for `batch` sequences of `context` tokens."""
    return 2 * arch.n_layers * arch.kv_dim * context * batch * bytes_per_element / tp


# ---- the whole picture -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
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
        )

    @property
    def total(self) -> float:
        """Peak plus the fragmentation and framework margin: what the device must hold."""
        return self.allocated_peak + self.margin

    def as_dict(self) -> dict[str, float | str]:
        """Bytes per component (for plan.json)."""
        return {
            "weights_bytes": self.weights,
            "gradients_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "autocast_weight_copies_bytes": self.weight_copies,
            "buffers_bytes": self.buffers,
            "transient_bytes": self.transient,
            "allocated_peak_bytes": self.allocated_peak,
            "margin_bytes": self.margin,
            "total_bytes": self.total,
            "peak_phase": self.phase,
            "peak_stage": self.stage,
        }


# ---- the parts of a stage's peak ---------------------------------------------------------------------------------


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class StageBuffers:
    """Bytes outside model states and activations: rope tables, DDP buckets, FSDP's root and gathered blocks."""

    resident: float  # alive through the whole step
    gathered: float  # FSDP: blocks gathered while backward runs (only counted at moments inside backward)


@dataclass(frozen=True)
class BackwardGradients:
    """Gradients alive during backward, in bytes, and the divisor ZeRO applies to a stage's gradients."""

    resident: float  # accumulated over micro-batches (or pipeline stages) until the optimizer step
    head: float  # the output layer's
    down_proj: float  # one block's MLP down projection (the first gradient its backward produces)
    divisor: int


@dataclass(frozen=True)
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


class MemoryModel:
    """Memory estimates for one architecture and precision; cheap to evaluate for many layouts."""

    def __init__(
        self, arch: Architecture, precision: Precision, runtime: Runtime | None = None, margin: Margin | None = None
    ) -> None:
        self.arch, self.p, self.rt = arch, precision, runtime or Runtime()
        self.margin = margin or Margin()
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
        self._act_cache: dict[tuple[str, int, int, bool], float] = {}
        self._shape_cache: dict[tuple[int, int, int, bool, bool], StageParams] = {}
        self._per_tensor_opt_transient = _per_tensor_adamw_temporaries(arch, pc)
        self._rope_buffers = 2 * arch.seq_len * (arch.head_dim // 2) * 4 if arch.positions == "rope" else 0

    def _act_bytes(self, recompute: str, micro_batch: int, tp: int, sp: bool) -> float:
        """Saved bytes of one block for one micro-batch (memoised: the search asks the same few many times)."""
        key = (recompute, micro_batch, tp, sp)
        cached = self._act_cache.get(key)
        if cached is None:
            cached = self._act_cache[key] = self._acts[recompute].bytes(micro_batch, self.arch.seq_len, tp, sp)
        return cached

    def estimate(self, layout: Layout) -> MemoryBreakdown:
        """Peak memory of the most loaded rank (the first or the last pipeline stage)."""
        if layout.pp == 1:
            return self._stage(layout, first=True, last=True)
        first = self._stage(layout, first=True, last=False)
        last = self._stage(layout, first=False, last=True)
        return first if first.total >= last.total else last

    def stage(self, layout: Layout, which: Literal["first", "last"]) -> MemoryBreakdown:
        """Peak memory of the first or the last pipeline stage."""
        return self._stage(layout, first=which == "first", last=which == "last" or layout.pp == 1)

    def _stage_params(self, lo: Layout, first: bool, last: bool) -> StageParams:
        """The stage's parameters on one rank (memoised: they depend on tp, ep, pp and the stage only)."""
        key = (lo.tp, lo.ep, lo.pp, first, last)
        params = self._shape_cache.get(key)
        if params is None:
            params = self._shape_cache[key] = stage_params(self.arch, self.params, lo, first, last)
        return params

    def _activations(self, lo: Layout, params: StageParams, first: bool, last: bool) -> StageActivations:
        """Saved activations of the stage and what changes while a block's backward runs."""
        arch, p, tp, b = self.arch, self.p, lo.tp, lo.micro_batch
        sp = lo.sequence_parallel and tp > 1
        tokens, layers = b * arch.seq_len, arch.n_layers / lo.pp
        # The first pipeline stage holds the micro-batches in flight (Korthikanti et al. 2022, section 4.2.3: p of
        # them for 1F1B, times 1 + (p-1)/(pv) when interleaved over v chunks).
        in_flight = 1.0
        if lo.pp > 1 and first:
            # GPipe runs every forward before the first backward: all micro-batches are in flight.
            in_flight = float(lo.grad_accum if lo.pp_schedule == "gpipe" else min(lo.pp, lo.grad_accum))
            if lo.pp_schedule == "interleaved":
                in_flight *= 1 + (lo.pp - 1) / (lo.pp * lo.virtual_stages)
        full = lo.recompute == "full"
        per_layer = self._act_bytes(lo.recompute, b, tp, sp)
        copies_per_layer = (params.layer - self.params.per_layer_norms) * p.weight_copy_bytes
        resting = per_layer + (0.0 if full else copies_per_layer)
        head_saved = tokens * (self._head_replicated / (tp if sp else 1) + 4 * arch.vocab_size / tp) if last else 0.0
        head_copies = (self.params.head or self.params.embedding) / tp * p.weight_copy_bytes if last else 0.0
        # The block whose backward runs: recomputed in full (its input is already counted), minus what is freed.
        working = -tokens * self._mlp_freed / tp
        if full:
            working += self._act_bytes("none", b, tp, sp) + copies_per_layer - tokens * p.residual_bytes * arch.d_model
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
            layer_transient=tokens * (arch.d_model * p.residual_bytes + self._mlp_transient / tp),
        )

    def _buffers(self, lo: Layout, params: StageParams) -> StageBuffers:
        """Rope tables, DDP's gradient buckets, FSDP's root and the blocks it gathers during backward."""
        resident = float(self._rope_buffers)
        if lo.zero == 0 and lo.dp > 1 and self.rt.ddp_buckets:
            resident += params.total * self.p.grad_bytes  # DDP's flat gradient buckets
        gathered = 0.0
        if lo.zero >= 3:
            if self.rt.fsdp_root_unsharded:
                resident += (params.embed + params.head) * self.p.weight_bytes  # FSDP2 keeps the root gathered
            # The block in backward and the one prefetched; with full recompute the recomputed forward's own
            # prefetch gathers a third.
            layers = self.arch.n_layers / lo.pp
            gathered = min(3.0 if lo.recompute == "full" else 2.0, layers) * params.layer * self.p.weight_bytes
        return StageBuffers(resident=resident, gathered=gathered)

    def _backward_gradients(self, lo: Layout, params: StageParams, states: ModelStates) -> BackwardGradients:
        """The gradients alive during backward: accumulated ones, the output layer's and a block's down projection."""
        gb = self.p.grad_bytes
        accumulating = lo.grad_accum > 1 or lo.pp > 1
        resident = states.gradients if accumulating else 0.0
        if accumulating and lo.zero >= 2 and self.rt.fsdp_accumulate_unsharded:
            resident = params.total * gb  # sync off on all but the last micro-batch: unsharded gradients pile up
        divisor = lo.shard if lo.zero >= 2 else 1
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
    ) -> list[Moment]:
        """The candidate peaks of a training step, in the order ties are decided (the earliest wins)."""
        gb, full = self.p.grad_bytes, acts.full_recompute
        copies_live = acts.in_flight * acts.layers * (0.0 if full else acts.copies_per_layer)
        top_live = acts.live - acts.head_saved - acts.head_copies + acts.working
        top_grads = (grads.resident if grads.resident > grads.head else grads.head) + grads.down_proj
        moments = [
            Moment(
                "backward, top block", top_live, top_grads, acts.layer_transient, gathered,
                copies_live + acts.copies_per_layer * full,
            )
        ]  # fmt: skip
        if last:
            loss_transient = acts.tokens * 8 * self.arch.vocab_size / lo.tp  # fp32 gradients of log-probs and logits
            moments.append(
                Moment(
                    "start of backward", acts.live, grads.resident, loss_transient, 0.0,
                    copies_live + acts.head_copies,
                )
            )  # fmt: skip
        bottom_live = (
            (acts.in_flight - 1) * acts.layers * acts.resting
            + (acts.per_layer if full else acts.resting)
            + acts.working
        )
        rest = params.total - params.layer - params.embed - params.head
        bottom_grads = rest * gb / grads.divisor + grads.head + grads.down_proj
        bottom_grads = grads.resident if grads.resident > bottom_grads else bottom_grads
        moments.append(
            Moment(
                "backward, bottom block", bottom_live, bottom_grads, acts.layer_transient, gathered,
                acts.copies_per_layer,
            )
        )  # fmt: skip
        if lo.zero >= 3:
            # End of a block's backward under FSDP: its saved tensors are gone, its whole unsharded gradient and
            # the reduce-scatter input copied from it are alive until the reduce-scatter.
            done_live = acts.live - acts.head_saved - acts.head_copies - (acts.per_layer if full else acts.resting)
            moments.append(
                Moment(
                    "backward, top block (reduce-scatter)", done_live, grads.head + 2 * params.layer * gb,
                    acts.tokens * self.arch.d_model * self.p.residual_bytes, gathered,
                    copies_live + acts.copies_per_layer * full,
                )
            )  # fmt: skip
        if self.rt.foreach_optimizer:
            opt_transient = states.optimizer_params * 4  # torch's foreach AdamW: one fp32 temporary per parameter
        else:
            opt_transient = self._per_tensor_opt_transient / lo.tp
        moments.append(Moment("optimizer step", 0.0, states.gradients, opt_transient, 0.0, 0.0))
        return moments

    def _stage(self, lo: Layout, first: bool, last: bool) -> MemoryBreakdown:
        """The stage's peak: its model states, buffers and the largest of its candidate moments."""
        params = self._stage_params(lo, first, last)
        states = model_states(params, self.p, lo)
        acts = self._activations(lo, params, first, last)
        buffers = self._buffers(lo, params)
        grads = self._backward_gradients(lo, params, states)
        moments = self._moments(lo, params, states, acts, grads, buffers.gathered, last)
        peak = moments[0]
        for moment in moments[1:]:
            if moment.total > peak.total:
                peak = moment
        copies = min(peak.weight_copies, peak.live)
        buffer_bytes = buffers.resident + peak.gathered
        allocated = states.weights + states.optimizer + buffer_bytes + peak.live + peak.gradients + peak.transient
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
            stage="only" if first and last else ("first" if first else "last"),
            states=states,
        )
