"""Gradient clipping by the global norm over every mesh dimension of a model-parallel layout.

torch's clip_grad_norm_ handles DTensor gradients of one mesh (FSDP2 x TP): their norms are reduced over the
shards of that mesh. What it cannot see is the parameters other ranks hold alone: the other pipeline stages'
layers and the other expert-parallel ranks' experts. So the squared norm is summed in three parts: this rank's
non-expert parameters (DTensor norms, complete over the data and tensor dimensions), its experts (summed over
the expert-parallel group, whose ranks hold different experts), and then over the pipeline group.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from training.mesh import Meshes


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms; DTensor gradients grouped by mesh so each group reduces over its own shards."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_mesh[getattr(g, "device_mesh", None)].append(g)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total = total + norm.float().pow(2)
    return total


def clip_grad_norm(model: nn.Module, max_norm: float, meshes: Meshes) -> torch.Tensor:
    """Clip every gradient of `model` (this rank's part) by the whole model's norm; return that norm."""
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    if not named:
        device = torch.device("cpu")
    else:
        device = named[0][1].grad.device  # type: ignore[union-attr]
    experts = [p.grad for name, p in named if ".experts." in name]
    dense = [p.grad for name, p in named if ".experts." not in name]
    squared = _squared_norm(dense, device)  # type: ignore[arg-type]
    if meshes.ep is not None:
        expert_sq = _squared_norm(experts, device)  # type: ignore[arg-type]
        dist.all_reduce(expert_sq, group=meshes.ep.get_group())
        squared = squared + expert_sq
    else:
        squared = squared + _squared_norm(experts, device)  # type: ignore[arg-type]
    if meshes.dims.pp > 1:
        dist.all_reduce(squared, group=meshes.pp.get_group())
    total = squared.sqrt()
    if named and max_norm != float("inf"):
        by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)  # foreach ops stay within one mesh
        for _, p in named:
            by_mesh[getattr(p, "device_mesh", None)].append(p)
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
