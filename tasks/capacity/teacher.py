"""The distillation teacher's share of a rank's memory and of the step time (the spec's `distill` section).

training/distill.py builds the teacher as a whole fp32 `Transformer` on every rank (data-parallel layouts only:
it is neither sharded nor wrapped), frozen, and runs its forward once per micro-batch under the trainer's autocast
and `torch.no_grad()`. So a rank holds, next to the student's training state:

- the teacher's weights: its parameters x 4 bytes, through the whole step;
- its logits of one micro-batch, micro_batch x seq_len x vocab fp32 values, kept until the KL term's backward;
- when the student's backward starts, the KL term's own vocabulary-sized fp32 tensors beside the cross-entropy's:
  the log-softmaxes of student/T and teacher/T that autograd saves and the gradients the term's backward makes,
  KL_LOSS_COPIES of them per position (torch's MemTracker on `distill_loss`: 7 at its peak against the plain
  cross-entropy's 3; a whole step agrees, tests/unit/capacity/test_measure.py);
- while its forward runs (the student's activations all saved by then), the working set of its largest block for
  one micro-batch, nothing of it saved for backward: the residual stream in and out, the MLP's inner tensors,
  the attention scores where attention is not fused, and autocast's 16-bit copy of the block's weights.

Its forward costs 2 x teacher params FLOPs per token, no backward and no recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.capacity.memory import Precision, Runtime
from tasks.capacity.params import Architecture, count_params

TEACHER_WEIGHT_BYTES = 4
"""load_teacher keeps the teacher in the dtype `Transformer` is built in: fp32."""
LOGIT_BYTES = 4
"""The KL term reads the teacher's logits as fp32 (distill_loss: `.float()`)."""
KL_LOSS_COPIES = 4
"""Vocabulary-sized fp32 tensors per position the KL term adds to the cross-entropy's at the start of backward."""


@dataclass(frozen=True)
class TeacherLoad:
    """What the frozen teacher adds to each rank: bytes held, bytes per token of a micro-batch, FLOPs per token."""

    params: int
    weights_bytes: float
    logits_bytes_per_token: float
    forward_bytes_per_token: float
    """The largest block's forward working set per token (transient, no autograd)."""
    forward_weight_copies_bytes: float
    """Autocast's 16-bit copy of one block's weights while it runs (0 without autocast)."""
    forward_flops_per_token: float
    kl_loss_bytes_per_token: float = 0.0
    """The KL term's tensors at the start of the student's backward (transient), per token."""

    @classmethod
    def of(cls, teacher: Architecture, precision: Precision, runtime: Runtime) -> TeacherLoad:
        """The load of `teacher` trained beside a student at `precision` (its autocast) on `runtime`."""
        pc = count_params(teacher)
        act = precision.act_bytes
        inner = (4 if teacher.mlp == "swiglu" else 2) * teacher.ffn_hidden * act * (teacher.top_k if teacher.is_moe
                                                                                     else 1)  # fmt: skip
        mlp = 2 * teacher.d_model * precision.residual_bytes + inner
        attention = 2 * teacher.d_model * precision.residual_bytes + (teacher.d_model + 2 * teacher.kv_dim) * act
        if runtime.attention == "math":  # scores and their softmax, per head and key position
            attention += 2 * teacher.n_heads * teacher.seq_len * act
        copies = pc.per_layer * precision.weight_copy_bytes
        return cls(
            params=pc.total,
            weights_bytes=float(pc.total * TEACHER_WEIGHT_BYTES),
            logits_bytes_per_token=float(teacher.vocab_size * LOGIT_BYTES),
            forward_bytes_per_token=float(max(mlp, attention)),
            forward_weight_copies_bytes=float(copies),
            forward_flops_per_token=2.0 * pc.total,
            kl_loss_bytes_per_token=float(KL_LOSS_COPIES * teacher.vocab_size * LOGIT_BYTES),
        )

    def logits_bytes(self, tokens: int) -> float:
        """The teacher's logits of a micro-batch of `tokens` tokens."""
        return self.logits_bytes_per_token * tokens

    def kl_loss_bytes(self, tokens: int) -> float:
        """The KL term's transient tensors when the loss's backward starts, for a micro-batch of `tokens` tokens."""
        return self.kl_loss_bytes_per_token * tokens

    def forward_bytes(self, tokens: int) -> float:
        """The transient working set of its forward on a micro-batch of `tokens` tokens."""
        return self.forward_bytes_per_token * tokens + self.forward_weight_copies_bytes

    def as_dict(self) -> dict[str, float]:
        """The teacher's own figures for plan.json."""
        return {
            "params": self.params,
            "weights_bytes": self.weights_bytes,
            "weight_bytes_per_param": TEACHER_WEIGHT_BYTES,
            "logits_bytes_per_token": self.logits_bytes_per_token,
            "forward_flops_per_token": self.forward_flops_per_token,
        }
