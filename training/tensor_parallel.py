"""Tensor (and sequence) parallelism of the Transformer with torch's `parallelize_module`, and the loss on
vocabulary-sharded logits (`loss_parallel`).

Megatron's layout, as torchtitan applies it: each block's Q/K/V and MLP up/gate
projections are split by output columns (each rank holds whole heads), the
attention output and MLP down projections by input rows, so a block costs one
all-reduce per branch in forward and one in backward: each branch's input becomes
one DTensor (`PrepareModuleInput`) that its column-wise projections share, so
autograd sums their partial input gradients before the single all-reduce (a plain
tensor per projection would all-reduce q, k, v, gate and up separately: five in
backward instead of two). The embedding is split by
vocabulary rows and the output layer by vocabulary columns; its logits stay
sharded and `loss_context` computes the cross-entropy on the shards.

With sequence parallelism the residual stream between the branches (norms,
dropout, residual adds) is split along the sequence instead of replicated: the
all-reduce becomes an all-gather before each branch and a reduce-scatter after
it (the same bytes), and the activations outside the matmuls take 1/TP of the
memory.

Every parameter becomes a DTensor on the tensor-parallel mesh (the norms'
weights replicated), so that FSDP2, the optimizer and the gradient norm see one
kind of tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from training.model import MoE, Transformer
from training.vision import VisionTransformer


@contextlib.contextmanager
def loss_context(tensor_parallel: bool) -> Iterator[None]:
    """Cross-entropy on logits sharded by vocabulary without gathering them; wrap forward loss and backward."""
    with loss_parallel() if tensor_parallel else contextlib.nullcontext():
        yield


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, T, V) logits (a DTensor sharded on V under loss_context) against
    (B, T) targets."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: under loss_context it is a DTensor replicated over the tensor-parallel ranks."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _replicated(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    """Plain tensors among `inputs` as DTensors replicated on `mesh` (every rank holds the whole value)."""
    return tuple(
        DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
        else t
        for t in inputs
    )


def _local(_mod: nn.Module, output: torch.Tensor, _mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local() if isinstance(output, DTensor) else output


class ReplicateParallel(ParallelStyle):
    """The module's parameters replicated on the mesh, its input and output plain replicated tensors: the
    norms between tensor-parallel regions without sequence parallelism (every rank computes them whole)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated, output_fn=_local)


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallel style of each projection (and, with sequence parallelism, norm) of one block."""
    # With sequence parallelism the branches take the sequence shard and gather it; their row-wise outputs are
    # reduce-scattered back onto the sequence shard, where dropout and the residual add run.
    residual = Shard(1) if sequence_parallel else Replicate()
    norm: ParallelStyle = SequenceParallel() if sequence_parallel else ReplicateParallel()
    plan: dict[str, ParallelStyle] = {
        "attn_norm": norm,
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=residual),
        "mlp_norm": SequenceParallel() if sequence_parallel else ReplicateParallel(),
    }
    # Each branch's input as one replicated DTensor (gathered from the sequence shard under sequence parallelism)
    # that its column-wise projections share: their partial input gradients add up as a DTensor and reach the
    # residual stream in one all-reduce (or reduce-scatter) per branch, Megatron's count.
    # (x, cos, sin): the RoPE tables are plain tensors every rank holds whole.
    plan["attn"] = PrepareModuleInput(
        input_layouts=(residual, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=False
    )
    if isinstance(block.mlp, MoE):
        # training/layout.py rejects tensor_parallel with MoE: experts are sharded by expert parallelism instead.
        return plan
    plan["mlp"] = PrepareModuleInput(
        input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    plan["mlp.w1"] = ColwiseParallel()
    if hasattr(block.mlp, "w3"):  # SwiGLU's gate; GeluMLP has none
        plan["mlp.w3"] = ColwiseParallel()
    plan["mlp.w2"] = RowwiseParallel(output_layouts=residual)
    return plan


def apply_vit_tensor_parallel(model: VisionTransformer, tp_mesh: DeviceMesh) -> None:
    """Shard a VisionTransformer over `tp_mesh` in place: in each block Q/K/V and the MLP's w1 by output columns
    (whole heads per rank, their biases with them), the attention output and w2 by input rows (bias replicated).

    The rest (patch embedding, class token, position embedding, LayerNorms, the classifier head) is replicated:
    the encoder runs on replicated DTensors between the sharded projections from the patch embedding's input on
    (so `features`, which a vision-language model calls, works too), and `forward` returns plain logits. The head
    is small, so the logits are whole on every rank and the loss is the plain cross-entropy (no loss_parallel).
    """
    plan: dict[str, ParallelStyle] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(use_local_output=False),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(use_local_output=False),
    }
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)
    # Every parameter not sharded above becomes a replicated DTensor (distribute_module leaves DTensors alone).
    distribute_module(model, tp_mesh, output_fn=_local)
    model.patch_embed.register_forward_pre_hook(lambda mod, inputs: _replicated(mod, inputs, tp_mesh))


def apply_vlm_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a vision-language model (training/vlm.py: `vision`, `projector`, `lm`) over `tp_mesh` in place: the
    vision tower as a ViT's (`apply_vit_tensor_parallel`), the language model as the Transformer's (its logits
    sharded on the vocabulary: the caption loss runs inside `loss_context(True)`), the projector replicated.

    The image tokens reach the language model as a plain (B, P, d_model) tensor whole on every rank, put in front
    of the token embeddings' output, which is plain and whole too (training/config.py refuses sequence
    parallelism for vlm: the language model's input would be a sequence shard of the captions only); rotary
    positions count from the first image token as on one process."""
    apply_vit_tensor_parallel(model.vision, tp_mesh)
    # The projector takes the tower's replicated DTensor and gives the language model a plain tensor.
    distribute_module(model.projector, tp_mesh, input_fn=_replicated, output_fn=_local)
    apply_tensor_parallel(model.lm, tp_mesh, sequence_parallel=False)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a whole Transformer or a pipeline chunk of it, a VisionTransformer or a vision-language
    model) over `tp_mesh` in place.

    Under sequence parallelism the hidden states between blocks (and between pipeline chunks) are this rank's
    slice of the sequence, (B, T / TP, D), as plain tensors; without it they are whole, (B, T, D). The logits
    are a DTensor sharded on the vocabulary: compute the loss with `lm_loss` inside `loss_context(True)`.
    """
    if isinstance(model, VisionTransformer):  # training/config.py refuses sequence parallelism for vit
        apply_vit_tensor_parallel(model, tp_mesh)
        return
    if not isinstance(model, Transformer):  # the vision-language model (training/vlm.py imports this module)
        apply_vlm_tensor_parallel(model, tp_mesh)
        return
    residual = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None:
        plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if model.cfg.tie_embeddings and model.tok_emb is not None and model.lm_head is not None:
        # Both are split by vocabulary rows (Shard(0)); parallelize_module gave each its own DTensor, so tie again.
        model.lm_head.weight = model.tok_emb.weight
