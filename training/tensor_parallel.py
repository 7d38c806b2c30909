"""Tensor (and sequence) parallelism of the Transformer with torch's `parallelize_module`, and the loss on
vocabulary-sharded logits (`loss_parallel`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel


@contextlib.contextmanager
def loss_context(tensor_parallel: bool) -> Iterator[None]:
    """Cross-entropy on logits sharded by vocabulary without gathering them; wrap forward loss and backward."""
    with loss_parallel() if tensor_parallel else contextlib.nullcontext():
        yield


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, T, V) logits (a DTensor sharded on V under loss_context) against
    (B, T) targets."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
