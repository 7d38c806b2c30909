"""Data parallelism as composable functions: DDP, FSDP2 full shard, and hybrid shard on a 2-D mesh."""

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
from training.metrics import CommTimer
from training.model import Transformer

log = logging.getLogger(__name__)


class ParallelismError(ValueError):
    """The requested layout does not fit the processes that were started."""


def data_parallel_mesh(cfg: ParallelConfig, world: int, local_world: int, device_type: str) -> DeviceMesh:
    """1-D mesh for fsdp; (replicate, shard) mesh for hsdp."""
    if cfg.sharding == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    shard = cfg.hsdp_shard_size or local_world
    if world % shard:
        raise ParallelismError(
            f"parallel.hsdp_shard_size={shard} does not divide the world size {world}; "
            f"use one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: Transformer, mesh: DeviceMesh, timer: CommTimer | None = None) -> Transformer:
    """FSDP2: shard every block, then the root (embeddings, final norm, output layer); `timer` times the
    all-gathers and reduce-scatters."""
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if timer is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(timer.all_gather())
                module.set_custom_reduce_scatter(timer.reduce_scatter())
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
    model: Transformer, cfg: ParallelConfig, device: torch.device, local_world: int, timer: CommTimer
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
    return cfg.sharding != "hsdp" or (cfg.hsdp_shard_size or local_world) > 1


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
