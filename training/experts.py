"""Expert parallelism for the MoE layer: experts sharded over the `ep` mesh dimension, tokens moved by all-to-all.

Every rank routes its own tokens with the replicated router and sorts the assignments by destination expert
(training/model.py MoE). An all-to-all of the per-expert counts (no autograd) tells each rank how many rows it
will receive from every peer; an autograd-capable all-to-all with uneven split sizes moves the rows to the ranks
that hold their experts, the local experts compute, and the same exchange with the splits swapped brings the
results back, where the MoE combines them with the routing weights in token order. Backward runs the two
exchanges in reverse. The load-balancing loss and the capacity limit stay per rank, exactly as without expert
parallelism, so an EP job drops the same assignments as the dense model run on each rank's tokens.

Gradients of the experts are reduced over `meshes.expert_dp` (the data-parallel ranks holding the same
experts) and those of everything else over `meshes.dp`, both divided by the data-parallel degree: that is the
caller's job (training/parallel.py, FSDP2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from training.mesh import Meshes
from training.model import MoE, Transformer


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers present in `model` (a whole model or a pipeline chunk)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_capacity_factor(model: nn.Module, factor: float | None) -> None:
    """Cap every MoE layer's experts at `factor` x their even share of a forward's assignments (None: dropless)."""
    for moe in moe_layers(model):
        moe.capacity_factor = factor


def take_dropped_tokens(model: nn.Module) -> int:
    """Assignments dropped by the capacity limit on this rank since the last call, summed over the MoE layers
    present; resets the counters."""
    total = 0
    for moe in moe_layers(model):
        total += moe.dropped_tokens
        moe.dropped_tokens = 0
    return total


@dataclass(frozen=True)
class ExpertParallelDispatch:
    """The MoE's expert computation over an expert-parallel group: rank r holds experts [r*L, (r+1)*L)."""

    group: dist.ProcessGroup
    ep: int
    local_experts: int

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert outputs of `rows`, grouped by global expert (`counts` rows each), in the same row order."""
        send_counts = torch.tensor(counts, dtype=torch.int64, device=rows.device)
        recv_counts = torch.empty_like(send_counts)
        # Even split: rank r receives every peer's counts for its L experts, (source rank, local expert).
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        input_splits = send_counts.view(self.ep, self.local_experts).sum(1).tolist()
        recv = recv_counts.view(self.ep, self.local_experts)
        output_splits = recv.sum(1).tolist()
        received = funcol.all_to_all_single_autograd(rows, output_splits, input_splits, self.group)
        # Rows arrive grouped by source rank, then expert; the experts want them grouped by expert.
        segment = torch.repeat_interleave(torch.arange(recv.numel(), device=rows.device), recv.reshape(-1))
        by_expert = torch.argsort(segment % self.local_experts, stable=True)
        out = moe.run_experts(received[by_expert], recv.sum(0).tolist())
        back = out[torch.argsort(by_expert)]
        return funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)


def apply_expert_parallel(model: Transformer, meshes: Meshes) -> None:
    """Keep this EP rank's experts in every MoE layer present and dispatch their tokens over `meshes.ep`."""
    if meshes.ep is None:
        return
    ep, rank = meshes.dims.ep, meshes.coords["ep"]
    assert meshes.ep.get_local_rank() == rank, "the ep coordinate must be the rank in the ep process group"
    group = meshes.ep.get_group()
    for block in model.blocks.values():
        moe = getattr(block, "mlp", None) if block is not None else None
        if not isinstance(moe, MoE):
            continue
        local = moe.n_experts // ep
        mine = {str(e) for e in range(rank * local, (rank + 1) * local)}
        for key in [k for k in moe.experts if k not in mine]:
            del moe.experts[key]
        moe.dispatch = ExpertParallelDispatch(group, ep, local)
