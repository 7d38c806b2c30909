"""Step time past FLOPs: memory-bound work from the bytes it moves, and each term of a step on the critical path.

Matmuls run at the accelerator's peak x an efficiency (compute.py). The rest of a block is memory-bound: norms,
residual adds, the activation function, rotary embeddings, dropout, and with non-fused attention the softmax over
the score matrices; the output layer adds the cross-entropy's softmax over the vocabulary. Their time is the bytes
they read and write at the accelerator's memory bandwidth x an efficiency. Each elementwise kernel reads its inputs
and writes its output once (a fused norm is one kernel, the payload's eager RMSNorm four: cast, square-mean,
scale, weight); backward moves about twice the forward's bytes (it reads the saved input and the incoming gradient
and writes the outgoing one); recompute moves the recomputed part's forward bytes again.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) splits the norms, residual adds and hidden dropout
along the sequence over the tensor-parallel ranks; without it each tensor-parallel rank repeats them on the whole
sequence, which is what makes it faster as well as smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.capacity.memory import Precision
from tasks.capacity.params import Architecture
from training.layout import Layout

BACKWARD_BYTES = 2.0
"""Backward bytes of an elementwise kernel as a multiple of its forward bytes."""
EAGER_NORM_PASSES = 4
"""Kernels of an unfused RMSNorm/LayerNorm, each reading and writing the hidden vector."""


@dataclass(frozen=True)
class BlockBytes:
    """Memory-bound bytes per token of one block's forward, split by what tensor parallelism does to them."""

    replicated: float
    """Norms, residual adds, hidden dropout: split over TP ranks only under sequence parallelism."""
    split: float
    """Activation function, rotary embeddings, and the non-fused attention's softmax: split over TP ranks."""
    attention_core: float
    """The part of `split` that selective recompute repeats (the non-fused attention's softmax and dropout)."""


def block_bytes(arch: Architecture, p: Precision, attention: str) -> BlockBytes:
    """Bytes per token that one block's memory-bound kernels read and write in the forward pass."""
    h, f, kv, heads, s = arch.d_model, arch.ffn_hidden, arch.kv_dim, arch.n_heads, arch.seq_len
    e, r = p.act_bytes, p.residual_bytes
    passes = EAGER_NORM_PASSES if arch.norm_impl == "eager" else 1
    norm = 4 * h if arch.norm_impl == "eager" else r * h  # the eager norm computes in fp32
    replicated = 2 * passes * 2 * norm  # two norms, each pass reads and writes h
    replicated += 2 * 3 * r * h  # two residual adds: read two, write one
    if arch.dropout:
        replicated += 2 * (2 * e * h + h)  # after attention and after the MLP: read, write and a 1-byte mask
    k = arch.top_k if arch.is_moe else 1
    act = (5 if arch.mlp == "swiglu" else 2) * f * e  # silu(a) * b reads a, writes silu, reads both, writes one
    split = k * act
    if arch.positions == "rope":
        split += 2 * (h + kv) * e  # q and k rotated: read and write
    core = 0.0
    if attention == "math":
        core = 2 * heads * s * e  # softmax over the scores: read and write
        if arch.dropout:
            core += heads * s * (2 * e + 1)  # dropout on the probabilities, with its mask
    return BlockBytes(replicated=replicated, split=split + core, attention_core=core)


def head_bytes(arch: Architecture) -> float:
    """Bytes per token of the output layer's cross-entropy, forward and backward: the fp32 logits read, the
    probabilities written, then read back for the gradient, which is written."""
    return 4 * 4 * arch.vocab_size


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class MemoryBound:
    """Memory-bound bytes and seconds of one optimizer step on the busiest rank."""

    bytes: float
    recompute_bytes: float
    seconds: float


def memory_bound(arch: Architecture, p: Precision, lo: Layout, attention: str, bandwidth_bytes_s: float) -> MemoryBound:
    """Bytes the busiest rank's memory-bound kernels move in one optimizer step, and their seconds at
    `bandwidth_bytes_s` (the accelerator's memory bandwidth x the efficiency its elementwise kernels reach)."""
    per = block_bytes(arch, p, attention)
    tp = lo.tp
    sp = lo.sequence_parallel and tp > 1
    per_token = per.replicated / (tp if sp else 1) + per.split / tp
    layers = max(lo.stage_layers(arch.n_layers)) if lo.pp > 1 else arch.n_layers
    tokens = lo.micro_batch * lo.grad_accum * arch.seq_len // lo.cp  # every micro-batch's share of this rank
    forward = tokens * layers * per_token
    recompute = 0.0
    if lo.recompute == "full":
        recompute = forward
    elif lo.recompute == "selective":
        recompute = tokens * layers * per.attention_core / tp
    total = forward * (1 + BACKWARD_BYTES) + recompute + tokens * head_bytes(arch) / tp
    return MemoryBound(bytes=total, recompute_bytes=recompute, seconds=total / bandwidth_bytes_s)


@dataclass(slots=True)  # built per evaluated layout: a frozen dataclass's __init__ is slower
class StepTime:
    """The terms of one optimizer step on the critical path, in seconds (each in the plan's output)."""

    matmul: float
    """Arithmetic at the sustained FLOP rate (recompute included)."""
    memory_bound: float
    """Norms, softmax, dropout, elementwise kernels and their recompute, at the memory bandwidth."""
    data_parallel_overlapped: float
    """Gradient reduction (and FSDP's gathers) hidden behind backward."""
    data_parallel_exposed: float
    tensor_parallel: float
    """Tensor-parallel collectives: on the critical path."""
    pipeline_parallel: float
    """Boundary sends between stages: on the critical path."""
    expert_parallel: float
    """Token dispatch and combine all-to-alls: on the critical path."""
    bubble: float
    """Pipeline fill and drain: (p - 1) / (m v) of the compute."""
    context_parallel: float = 0.0
    """Keys and values gathered over the context-parallel ranks (and their gradients reduce-scattered)."""
    teacher_forward: float = 0.0
    """distill: the frozen teacher's forward on every micro-batch (2 x its params FLOPs per token, no backward)."""

    @property
    def compute(self) -> float:
        """Matmuls, memory-bound work and the distillation teacher's forward."""
        return self.matmul + self.memory_bound + self.teacher_forward

    @property
    def exposed_communication(self) -> float:
        """Communication on the critical path."""
        return (
            self.data_parallel_exposed
            + self.tensor_parallel
            + self.pipeline_parallel
            + self.expert_parallel
            + self.context_parallel
        )

    @property
    def total(self) -> float:
        """The step: compute, exposed communication and the bubble."""
        return self.compute + self.exposed_communication + self.bubble

    def terms(self) -> dict[str, float]:
        """Every term by name (plan.json)."""
        return {
            "matmul_seconds": self.matmul,
            "memory_bound_seconds": self.memory_bound,
            "teacher_forward_seconds": self.teacher_forward,
            "data_parallel_overlapped_seconds": self.data_parallel_overlapped,
            "data_parallel_exposed_seconds": self.data_parallel_exposed,
            "tensor_parallel_seconds": self.tensor_parallel,
            "pipeline_parallel_seconds": self.pipeline_parallel,
            "expert_parallel_seconds": self.expert_parallel,
            "context_parallel_seconds": self.context_parallel,
            "bubble_seconds": self.bubble,
            "step_seconds": self.total,
        }
