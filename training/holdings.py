"""What this rank holds of the model: its parameter pieces (for the end-of-run params record that acceptance
checks replicas and the reference comparison by) and the layers and experts it runs (for the mesh record)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import nn

from training.config import ModelConfig
from training.model import MoE
from training.run_output import ParamPiece, ParamRecord


def tied_names(model: ModelConfig) -> dict[str, str]:
    """Parameter name -> the name it shares its tensor with, by the model's definition."""
    return {"lm_head.weight": "tok_emb.weight"} if model.tie_embeddings else {}


_WRAPPERS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Attribute names that wrappers put in front of a parameter's name: DDP, torch.compile, activation checkpointing."""


def canonical_name(name: str) -> str:
    """A parameter's name as the bare model spells it (DDP's `module.` and other wrappers' parts left out), so that
    a wrapped run's records compare with the single-process reference's."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


@torch.no_grad()
def param_pieces(model: nn.Module) -> list[ParamPiece]:
    """Every parameter this rank holds, tied ones under each name, as pieces of the whole: a DTensor's local
    shard at its global offset (torch's own placement arithmetic), a plain tensor whole at offset 0."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed is imported by then
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    pieces = []
    for wrapped, param in model.named_parameters(remove_duplicate=False):
        name = canonical_name(wrapped)
        if isinstance(param, DTensor):
            local = param.to_local()
            _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        else:
            local, offset = param, (0,) * param.dim()
        host = local.detach().cpu().contiguous()
        values = host.double()
        pieces.append(
            ParamPiece(
                name=name,
                offset=[int(o) for o in offset],
                shape=list(host.shape),
                full_shape=list(param.shape),
                sha256=hashlib.sha256(np.ascontiguousarray(host.view(torch.uint8).numpy())).hexdigest(),
                sum=float(values.sum()),
                sq_sum=float(values.pow(2).sum()),
            )
        )
    return pieces


def param_record(model: nn.Module, rank: int, step: int, model_cfg: ModelConfig) -> ParamRecord:
    """The params record of `rank` at the end of the run."""
    return ParamRecord(rank=rank, step=step, pieces=param_pieces(model), tied=tied_names(model_cfg))


def held_layers(model: nn.Module) -> dict[str, object]:
    """The transformer layers this rank runs (global indices: a pipeline chunk keeps them as keys) and, per MoE
    layer, the experts it holds. A vision-language model's `layers` are its language model's (those model.n_layers
    counts), its vision tower's beside them as `vision_layers`."""
    vision, language = getattr(model, "vision", None), getattr(model, "lm", None)
    if isinstance(vision, nn.Module) and isinstance(language, nn.Module):  # training/vlm.py
        return {**held_layers(language), "vision_layers": held_layers(vision)["layers"]}
    blocks = getattr(model, "blocks", None) or {}
    experts = {}
    for key, block in blocks.items():
        moe = getattr(block, "mlp", None)
        if isinstance(moe, MoE):
            experts[str(key)] = sorted(int(e) for e in moe.experts)
    return {"layers": sorted(int(k) for k in blocks), "experts": experts}
