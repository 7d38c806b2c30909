"""Data parallelism as composable functions: DDP, FSDP2 full shard, and hybrid shard on a 2-D mesh; and the
model-parallel wrapping (tensor, expert, then FSDP2 over the data-parallel mesh) of a whole model or of a
pipeline chunk."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from training.config import ParallelConfig
from training.layout import Layout
from training.mesh import Meshes
from training.metrics import CommTimer
from training.model import MoE, blocks_of
from training.tensor_parallel import apply_tensor_parallel

log = logging.getLogger(__name__)


class ParallelismError(ValueError):
    """The requested layout does not fit the processes that were started."""


def data_parallel_mesh(cfg: ParallelConfig, world: int, local_world: int, device_type: str) -> DeviceMesh:
    """1-D mesh for fsdp; (replicate, shard) mesh for hsdp."""
    if cfg.sharding == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    shard = Layout.of(cfg, world, local_world).shard
    if world % shard:
        raise ParallelismError(
            f"parallel.hsdp_shard_size={shard} does not divide the world size {world}; "
            f"use one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, timer: CommTimer | None = None) -> nn.Module:
    """FSDP2: shard every block (`blocks_of`: a vision-language model's encoder blocks and language model blocks
    alike), then the root (embeddings, final norm, output layer; a projector); `timer` times the all-gathers and
    reduce-scatters."""
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _time_collectives(model, timer)
    return model


def _time_collectives(model: nn.Module, timer: CommTimer | None) -> None:
    if timer is None:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(timer.all_gather())
            module.set_custom_reduce_scatter(timer.reduce_scatter())


def apply_model_parallel(model: nn.Module, cfg: ParallelConfig, meshes: Meshes, timer: CommTimer | None) -> nn.Module:
    """Tensor parallel over meshes.tp, expert parallel over meshes.ep, then FSDP2 over meshes.dp, in place, on
    a whole model or a pipeline chunk (a Transformer with some blocks and tok_emb/norm/lm_head possibly None), a
    VisionTransformer, or a vision-language model.

    Each block is one FSDP2 unit and the root another; a MoE block's experts are a unit of their own over the
    ranks that hold the same experts (meshes.expert_dp), so experts are never averaged across EP ranks that
    hold different ones. With one data-parallel rank there is nothing to synchronise and FSDP2 is not applied
    (use `gradient_sync`, which handles both, for gradient accumulation).
    """
    dims = meshes.dims
    if dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, cfg.sequence_parallel)
    if dims.ep > 1:
        from training.experts import apply_expert_parallel  # noqa: PLC0415 - only expert-parallel layouts need it

        apply_expert_parallel(model, meshes)
    if dims.dp == 1:  # expert_parallel divides dp, so there are no experts to shard either
        return model
    # Under pipeline parallelism a stage runs forward once per microbatch: keep the gathered parameters instead
    # of gathering them again each time (torchtitan's default for PP).
    reshard = dims.pp == 1
    for block in blocks_of(model):
        if dims.ep > 1 and isinstance(block.mlp, MoE):
            assert meshes.expert_dp is not None
            experts = block.mlp.experts
            units = fully_shard(
                list(experts.values()) if isinstance(experts, nn.ModuleDict) else experts,
                mesh=meshes.expert_dp,
                reshard_after_forward=reshard,
            )
            unit = units[0] if isinstance(units, list) else units
            # An expert's gradient sums the tokens of every EP peer's samples: the mean over all dp ranks'
            # samples divides by dp, not by the expert_dp ranks it is reduced over (torchtitan does the same).
            unit.set_gradient_divide_factor(dims.dp)
            if meshes.expert_dp.device_type == "cpu" and meshes.expert_dp.size() > 1:
                # gloo has no PREMUL_SUM, which FSDP2 uses for a divide factor other than the group size:
                # sum, then divide. Not on a one-rank group (EP over every data-parallel rank): there FSDP2
                # skips the collective and divides its copy by the factor, and forcing the sum divided the
                # gradient a second time (torch 2.13 foreach_reduce), halving every expert's at dp=2.
                unit.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=meshes.dp, reshard_after_forward=reshard)
    fully_shard(model, mesh=meshes.dp, reshard_after_forward=reshard)
    _time_collectives(model, timer)
    return model


def apply_ddp(model: nn.Module, cfg: ParallelConfig, device: torch.device, timer: CommTimer) -> nn.Module:
    """DDP with a timed (optionally compressing) gradient all-reduce hook."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        # The model's buffers (RoPE tables) are constants every rank computes from the config: broadcasting
        # them before every forward would be a collective outside the timed ones, booked as compute.
        broadcast_buffers=False,
    )
    hook = {
        None: default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }[cfg.ddp_grad_compression]
    ddp.register_comm_hook(state=None, hook=timer.wrap(hook))
    return ddp


def parallelize(
    model: nn.Module, cfg: ParallelConfig, device: torch.device, local_world: int, timer: CommTimer
) -> nn.Module:
    """Wrap the model for the configured data parallelism (nothing to wrap with one process)."""
    world = dist.get_world_size()
    if cfg.data_parallel is not None and cfg.data_parallel != world:
        raise ParallelismError(
            f"parallel.data_parallel={cfg.data_parallel} but {world} processes were started; "
            f"set it to {world} or start {cfg.data_parallel} processes"
        )
    if cfg.sharding == "ddp":
        return apply_ddp(model, cfg, device, timer) if world > 1 else model
    return apply_fsdp(model, data_parallel_mesh(cfg, world, local_world, device.type), timer)


def comm_timed(cfg: ParallelConfig, world: int, local_world: int) -> bool:
    """The CommTimer sees this layout's gradient synchronisation: DDP's all-reduce, or FSDP's reduce-scatter
    (HSDP with one rank per shard group synchronises through an all-reduce only, which it does not see)."""
    if world == 1:
        return False
    return cfg.sharding != "hsdp" or Layout.of(cfg, world, local_world).shard > 1


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction on non-final micro-steps of gradient accumulation."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
