"""Communication per step: bytes each GPU sends for data, tensor, pipeline and expert parallelism, and the time.

Ranks are placed tensor-parallel first (within a node), then data-parallel, then pipeline stages; a group whose
ranks span more than one node runs at the inter-node bandwidth. Collective volumes are the ring algorithms':
an all-reduce sends 2(n-1)/n of the buffer, an all-gather or reduce-scatter (n-1)/n, an all-to-all (n-1)/n.
Bytes are the busiest rank's, counted the way the payload communicates (checked against the trainer by
benchmarks/parallel_comm.py, which counts its collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.capacity.catalogue import Accelerator
from tasks.capacity.memory import Precision
from tasks.capacity.params import Architecture, ParamCount
from training.layout import Layout


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class CommEstimate:
    """Bytes per GPU per step and seconds, by kind of parallelism."""

    bytes: dict[str, float]
    seconds: dict[str, float]
    exposed_seconds: float
    bubble_seconds: float
    ratio_to_compute: float
    warnings: list[str] = field(default_factory=list)
    hidden_seconds: float = 0.0
    """Data-parallel communication hidden behind backward."""

    @property
    def total_seconds(self) -> float:
        """Communication time before any overlap."""
        return sum(self.seconds.values())


def _ring(n: int, kind: str) -> float:
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n


def _bandwidth(acc: Accelerator, span_ranks: int, gpus_per_node: int) -> float:
    """Bytes/s per GPU of a group whose members lie within `span_ranks` consecutive ranks."""
    gb_s = acc.intra_node_gb_s if span_ranks <= gpus_per_node else acc.inter_node_gb_s
    return gb_s * 1e9


def tensor_parallel_block_reduces(layout: Layout) -> float:
    """All-reduces of the hidden states (or their bytes in all-gathers and reduce-scatters) one block sends per
    micro-batch under tensor parallelism, forward, backward and recompute together (see `communication`)."""
    if layout.tp <= 1:
        return 0.0
    recompute = 0.0
    if layout.recompute == "full":
        recompute = 1.5 if layout.sequence_parallel else 1.0
    return 4 + recompute


def communication(
    arch: Architecture,
    pc: ParamCount,
    precision: Precision,
    layout: Layout,
    acc: Accelerator,
    gpus_per_node: int,
    compute_seconds: float,
    overlap: bool = True,
    warn_ratio: float = 1.0,
    overlap_fraction: float = 1.0,
    scatter_gather: bool = False,
) -> CommEstimate:
    """Bytes and seconds of one optimizer step's communication for `layout` on `acc`.

    `compute_seconds` is the step's compute (matmuls and memory-bound work); `overlap_fraction` the share of the
    backward pass that data-parallel traffic can hide behind (measured: DDP's buckets start only once the first
    gradients are ready). `scatter_gather`: Megatron-LM's pipeline boundary tensors, sent 1/TP by each
    tensor-parallel rank and all-gathered over TP on arrival (the payload sends the whole tensor from each).
    """
    lo = layout
    m, tp, dp, pp, cp = lo.grad_accum, lo.tp, lo.dp, lo.pp, lo.cp
    tokens = lo.micro_batch * arch.seq_len // cp  # this rank's share of its micro-batch
    layers = max(lo.stage_layers(arch.n_layers)) if pp > 1 else arch.n_layers  # the busiest stage's blocks
    dense = (pc.total - pc.experts) / (tp * pp)
    experts = pc.experts / (tp * pp * lo.ep)
    params_rank = dense + experts
    sent: dict[str, float] = {}
    secs: dict[str, float] = {}

    # Data parallel: gradients once per step (the payload skips the sync on all but the last micro-batch).
    # ZeRO-3/FSDP2 also gathers the weights, every unit's (blocks and the root) for the forward and again for the
    # backward of every micro-batch; under pipelining once per step (the schedule keeps the gathered weights over
    # the microbatches and reduce-scatters after the last). With expert parallelism the experts are
    # sharded (FSDP2) over the dp/ep ranks that hold the same experts, whatever the sharding of the rest.
    # Context-parallel ranks hold the same weights: gradients reduce, and shards spread, over dp x cp.
    shard = lo.shard * cp if lo.zero else 1
    replicas = dp // lo.shard if lo.zero else dp * cp
    sharded_experts = lo.ep > 1 and arch.is_moe
    if not sharded_experts:
        dense, experts = params_rank, 0.0
    gathers = 1 if pp > 1 else 2 * m
    if lo.zero >= 3:
        shard_bytes = gathers * dense * precision.weight_bytes * _ring(shard, "all-gather")
        shard_bytes += dense * precision.grad_bytes * _ring(shard, "reduce-scatter")
        replica_bytes = dense * precision.grad_bytes / shard * _ring(replicas, "all-reduce")
    else:
        shard_bytes = dense * precision.grad_bytes * _ring(dp * cp, "all-reduce")
        replica_bytes = 0.0
    expert_group = dp * cp // lo.ep if sharded_experts else 1
    expert_bytes = gathers * experts * precision.weight_bytes * _ring(expert_group, "all-gather")
    expert_bytes += experts * precision.grad_bytes * _ring(expert_group, "reduce-scatter")
    sent["data_parallel"] = shard_bytes + replica_bytes + expert_bytes
    dp_span = tp * (shard if lo.zero >= 3 else dp * cp)
    secs["data_parallel"] = (
        shard_bytes / _bandwidth(acc, dp_span, gpus_per_node)
        + replica_bytes / _bandwidth(acc, tp * dp * cp, gpus_per_node)
        + expert_bytes / _bandwidth(acc, tp * dp * cp, gpus_per_node)
    )

    # Tensor parallel, per block and micro-batch, in all-reduces of the hidden states (Megatron's count,
    # Narayanan et al. 2021 section 3.2): one per region (attention, MLP) in forward, after the row-wise output
    # and down projections, and one per region in backward, where the column-wise projections' partial input
    # gradients, summed first, reach the residual stream; with sequence parallelism an all-gather and a
    # reduce-scatter in place of each (the same bytes). A full recompute repeats the forward's only as far as
    # the backward needs (torch's checkpoint stops once the saved tensors are back): the attention's all-reduce,
    # not the MLP's; with sequence parallelism the attention's gather and reduce-scatter and the MLP's gather.
    # Per micro-batch the vocabulary-parallel embedding (forward) and the output layer's input gradient
    # (backward) add one each on the stages that hold them, and the cross-entropy on the vocabulary shards
    # all-reduces three fp32 values per token (the logits' maximum, the sum of exponentials, the target's logit).
    per_block = tokens * arch.d_model * precision.act_bytes
    block_reduces = tensor_parallel_block_reduces(lo)
    ends = 2 if pp == 1 else 1
    loss_values = 3 * tokens * 4
    tp_bytes = m * ((layers * block_reduces + ends) * per_block + loss_values) * _ring(tp, "all-reduce")
    sent["tensor_parallel"] = tp_bytes
    secs["tensor_parallel"] = tp_bytes / _bandwidth(acc, tp, gpus_per_node)

    # Pipeline: each micro-batch's activations forward and their gradients backward across every chunk boundary
    # (1/TP of them under sequence parallelism). The busiest rank is a middle stage, which sends both for each
    # of its chunks; with two stages every rank holds the first or the last chunk, which sends one.
    whole = tokens * arch.d_model * precision.act_bytes
    split_boundary = lo.sequence_parallel or scatter_gather
    boundary = whole / (tp if split_boundary else 1)
    chunks = lo.virtual_stages if lo.pp_schedule == "interleaved-1f1b" else 1
    sends = 2 * chunks - (1 if pp == 2 else 0)
    pp_bytes = sends * m * boundary if pp > 1 else 0.0
    sent["pipeline_parallel"] = pp_bytes
    secs["pipeline_parallel"] = pp_bytes / _bandwidth(acc, tp * cp * dp * 2, gpus_per_node) if pp > 1 else 0.0
    if pp > 1 and scatter_gather and not lo.sequence_parallel and tp > 1:
        # Each received boundary tensor is all-gathered over the tensor-parallel group (fast intra-node links).
        gather = sends * m * whole * _ring(tp, "all-gather")
        sent["tensor_parallel"] += gather
        secs["tensor_parallel"] += gather / _bandwidth(acc, tp, gpus_per_node)

    # Expert parallel: dispatch and combine all-to-alls per MoE block, forward and backward (and recompute).
    ep_bytes = 0.0
    if arch.is_moe and lo.ep > 1:
        routed = tokens * arch.top_k * arch.d_model * precision.act_bytes
        passes = 3 if lo.recompute == "full" else 2  # forward, backward, and the recomputed forward
        ep_bytes = m * layers * passes * 2 * routed * _ring(lo.ep, "all-to-all")
    sent["expert_parallel"] = ep_bytes
    secs["expert_parallel"] = ep_bytes / _bandwidth(acc, tp * lo.ep, gpus_per_node) if ep_bytes else 0.0

    # Context parallel (Llama 3's all-gather attention): per block and micro-batch the whole sequence's keys and
    # values are all-gathered over the cp ranks in forward (again under full recompute) and their gradients
    # reduce-scattered in backward; on the critical path (the attention waits for them).
    cp_bytes = 0.0
    if cp > 1:
        kv = 2 * lo.micro_batch * arch.seq_len * arch.kv_dim / tp * precision.act_bytes
        passes = 3 if lo.recompute == "full" else 2
        cp_bytes = m * layers * passes * kv * _ring(cp, "all-gather")
    sent["context_parallel"] = cp_bytes
    secs["context_parallel"] = cp_bytes / _bandwidth(acc, tp * cp, gpus_per_node) if cp_bytes else 0.0

    # What stays on the critical path: TP, PP, EP and CP traffic; DP traffic beyond what the backward hides.
    # DDP and ZeRO-1/2 reduce after the last micro-batch's backward; FSDP's gathers overlap all of compute.
    backward_share = compute_seconds * (2 / 3) / max(1, m) if lo.zero < 3 else compute_seconds
    hidden = min(secs["data_parallel"], backward_share * overlap_fraction) if overlap else 0.0
    exposed = secs["tensor_parallel"] + secs["pipeline_parallel"] + secs["expert_parallel"] + secs["context_parallel"]
    exposed += secs["data_parallel"] - hidden
    bubble = 0.0
    if pp > 1:
        bubble = compute_seconds * (pp - 1) / (m * (lo.virtual_stages if lo.pp_schedule == "interleaved-1f1b" else 1))
    total = sum(secs.values())
    ratio = total / compute_seconds if compute_seconds else float("inf")
    warnings = []
    if ratio > warn_ratio:
        worst = max(secs, key=lambda k: secs[k])
        warnings.append(
            f"communication would dominate: {total:.3g} s of communication per step against {compute_seconds:.3g} s "
            f"of compute (ratio {ratio:.2f} > {warn_ratio}); most of it is {worst.replace('_', ' ')}"
        )
    return CommEstimate(
        bytes=sent, seconds=secs, exposed_seconds=exposed, bubble_seconds=bubble, ratio_to_compute=ratio,
        warnings=warnings, hidden_seconds=hidden,
    )  # fmt: skip
