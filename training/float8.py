"""precision.dtype fp8: the Linear layers of the transformer blocks trained in float8 with torchao (rowwise scaling).

As torchtitan does (torchtitan/components/quantization/float8.py): every nn.Linear inside a block whose two
dimensions are multiples of 16 (the float8 tensor cores' requirement) becomes torchao's Float8Linear with the
"rowwise" recipe (dynamic per-row scales, e4m3 for inputs, weights and gradients); the embeddings, the output head
(lm_head, a ViT's classifier) and the blocks' MoE routers and experts stay in bf16 under the same autocast. The
swap keeps the parameters' names, so checkpoints and exports are those of a bf16 run. It happens on the model
before run.compile and the parallel layouts wrap the blocks.

Float8 matmuls need CUDA compute capability 8.9 or newer (H100/H200/L4/L40S, B200): the spec refuses fp8 on CPU
clusters and `require_float8_device` refuses it again where the job actually starts. torchao is imported here
only, and only with fp8 (it is optional: the `fp8` extra of the payload wheel).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

RECIPE = "rowwise"
"""torchao's Float8LinearConfig recipe (torchao >= 0.9: Float8LinearConfig.from_recipe_name)."""
MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability float8 matmuls (torch._scaled_mm) need: Ada (sm_89) and Hopper (sm_90) onwards."""
DIM_MULTIPLE = 16
"""Float8 tensor cores need both dimensions of a converted weight to be multiples of 16."""
KEPT_IN_BF16 = ("router", "experts")
"""Parts of a block kept out of the conversion: an MoE router (its softmax decides routing, torchtitan keeps it in
high precision) and the experts (small per-expert batches, possibly empty, which dynamic scales do not suit)."""
FIX = "set precision.dtype: bf16 here; fp8 needs H100-class GPUs (CUDA compute capability 8.9+, sm_89)"


class Float8Unavailable(ValueError):
    """precision.dtype fp8 cannot run where the job started (no CUDA device, an older GPU, or torchao missing)."""

    def __init__(self, problem: str, fix: str = FIX) -> None:
        super().__init__(f"precision.dtype=fp8: {problem}; {fix}")
        self.problem, self.fix = problem, fix


def converts(module: nn.Module, fqn: str) -> bool:
    """Whether the module at `fqn` (its name inside a block) becomes a Float8Linear: an nn.Linear with both
    dimensions multiples of 16, outside an MoE router or the experts."""
    if not isinstance(module, nn.Linear):
        return False
    if any(part in KEPT_IN_BF16 for part in fqn.split(".")):
        return False
    out_features, in_features = module.weight.shape
    return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0


def require_float8_device(device: torch.device) -> None:
    """Raise Float8Unavailable unless `device` is a CUDA GPU with compute capability 8.9 or newer."""
    if device.type != "cuda":
        raise Float8Unavailable(f"the job runs on {device.type}, and float8 matmuls need a CUDA GPU")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise Float8Unavailable(
            f"{name} has compute capability {capability[0]}.{capability[1]} (< {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]})"
        )


def float8_config() -> object:
    """torchao's Float8LinearConfig for the rowwise recipe; Float8Unavailable when torchao is missing or too old."""
    try:
        from torchao.float8 import Float8LinearConfig  # noqa: PLC0415 - optional, precision.dtype fp8 only
    except ImportError as err:
        raise Float8Unavailable(
            "torchao is not installed where the job runs",
            "install the payload with its fp8 extra (pip install 'tdeploy-training[fp8]', or torchao in "
            "image.extra_requirements), or set precision.dtype: bf16",
        ) from err
    if not hasattr(Float8LinearConfig, "from_recipe_name"):
        raise Float8Unavailable("the installed torchao is older than 0.9 (no float8 recipes)", "install torchao>=0.9")
    return Float8LinearConfig.from_recipe_name(RECIPE)


def convert_blocks(blocks: Iterable[nn.Module]) -> int:
    """Swap the Linear layers `converts` selects inside each block for torchao's Float8Linear, in place; the number
    swapped. Checks nothing about the device: the trainer calls `require_float8_device` first."""
    config = float8_config()
    from torchao.float8 import convert_to_float8_training  # noqa: PLC0415 - optional, precision.dtype fp8 only

    # torchtitan's workaround for rowwise scales under inductor (pytorch/pytorch#150859): compiled casts round as
    # eager ones do, so a compiled fp8 run matches an eager one.
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - only where fp8 is on

    inductor_config.emulate_precision_casts = True
    swapped = 0
    for block in blocks:
        before = sum(1 for _ in _float8_linears(block))
        convert_to_float8_training(block, config=config, module_filter_fn=converts)
        swapped += sum(1 for _ in _float8_linears(block)) - before
    log.info("precision fp8: %d Linear layers of the blocks in float8 (torchao, %s scaling)", swapped, RECIPE)
    return swapped


def _float8_linears(module: nn.Module) -> Iterable[nn.Module]:
    return (m for m in module.modules() if type(m).__name__ == "Float8Linear")
