"""A fresh optimizer's state, made to be loaded into: what the optimizer's first step would create, without the step.

DCP's `get_state_dict` gives an optimizer without state one by running a step with zero gradients and a zero
learning rate (zeros for every gradient, a whole Adam update over every parameter): about half of a resume's load
on the CPU. For Adam and AdamW the state is known: per parameter that trains, `step` (a scalar tensor, on the
parameter's device where the optimizer is fused or capturable, as Adam's `_init_group` puts it), `exp_avg`,
`exp_avg_sq` and with amsgrad `max_exp_avg_sq`, shaped, typed and placed like the parameter (a DTensor parameter
gets DTensor state with its placements). The tensors are allocated, not filled: the load overwrites every element
(DCP refuses a checkpoint that lacks one of the keys), and a load that fails clears the state again. Any other
optimizer goes DCP's way.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

_ADAM_KINDS = (torch.optim.Adam, torch.optim.AdamW)  # AdamW is a subclass of Adam: the same state


def make_state_to_load(optimizer: torch.optim.Optimizer) -> bool:
    """Give a state-less Adam/AdamW the state tensors its first step would create, left unfilled for a load to write
    (True); False, and nothing done, for any other optimizer, one with state, or one whose parameters have gradients
    (DCP then does what it does for them)."""
    if optimizer.state or type(optimizer) not in _ADAM_KINDS:
        return False
    groups = optimizer.param_groups
    if any(p.grad is not None for group in groups for p in group["params"]):
        return False
    for group in groups:
        fused, on_device = bool(group.get("fused")), bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            if not param.requires_grad:
                continue
            state = optimizer.state[param]
            state["step"] = torch.empty(
                (), dtype=_get_scalar_dtype(is_fused=fused), device=param.device if on_device else "cpu"
            )
            state["exp_avg"] = torch.empty_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.empty_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.empty_like(param, memory_format=torch.preserve_format)
    return True
