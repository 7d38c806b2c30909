"""Model-parallel bugs for the correctness tests, applied in a job's processes by tests/faults/harness/sitecustomize.py.

Each function patches the payload the way the bug would be written, without any switch in the payload itself.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from tests.faults import HARNESS, ROOT


def patched(function: str) -> dict[str, str]:
    """The job environment variables that apply `function` of this module in the job's processes."""
    path = os.pathsep.join([str(HARNESS), str(ROOT)])
    return {"PYTHONPATH": path, "TDEPLOY_TEST_PATCH": f"{__name__}:{function}"}


class _LocalNormSequenceParallel(SequenceParallel):
    """Sequence-parallel norm whose weight is used as this rank's local tensor: its gradient (from this rank's
    slice of the sequence only) is never all-reduced over the tensor-parallel group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)

        def forward(x: torch.Tensor) -> torch.Tensor:
            local = x.to_local()
            normed = local.float() * torch.rsqrt(local.float().pow(2).mean(-1, keepdim=True) + module.eps)
            out = normed.type_as(local) * module.weight.to_local()
            return DTensor.from_local(out, device_mesh, (Shard(1),), run_check=False)

        module.forward = forward
        return module


def sp_norm_grads_not_reduced() -> None:
    """The blocks' sequence-parallel norms keep each tensor-parallel rank's half of their weight gradient."""
    from training import tensor_parallel  # noqa: PLC0415 - patched in the job's processes only

    original = tensor_parallel._block_plan  # noqa: SLF001

    def plan(block: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
        styles = original(block, sequence_parallel)
        if sequence_parallel:
            styles["attn_norm"] = styles["mlp_norm"] = _LocalNormSequenceParallel()
        return styles

    tensor_parallel._block_plan = plan  # noqa: SLF001


def ep_gradient_divide_factor_ignored() -> None:
    """The experts' FSDP2 units divide their gradients by their own group's size, not by the data-parallel degree
    (expert gradients too large by dp / expert_dp)."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    FSDPModule.set_gradient_divide_factor = lambda self, factor: None  # type: ignore[method-assign]


def clip_norm_without_other_experts() -> None:
    """Gradient clipping by a norm that leaves out the other expert-parallel ranks' experts."""
    from training import grad_clip  # noqa: PLC0415

    original = grad_clip.clip_grad_norm

    def clip(model: nn.Module, max_norm: float, meshes: Any) -> torch.Tensor:
        return original(model, max_norm, dataclasses.replace(meshes, experts=None))

    grad_clip.clip_grad_norm = clip


def pipeline_drops_a_layer() -> None:
    """The pipeline split skips the first layer of the second chunk: `layers 0-1 | 3-4` for 4 layers."""
    from training import pipeline  # noqa: PLC0415

    original = pipeline.split_ranges

    def split(sizes: list[int]) -> list[range]:
        ranges = original(sizes)
        return [ranges[0], *(range(r.start + 1, r.stop + 1) for r in ranges[1:])]

    pipeline.split_ranges = split
