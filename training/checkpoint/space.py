"""How much room a checkpoint needs before its save starts, and how many files (writer threads) a rank writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Bytes a checkpoint needs beyond its tensor data: DCP's per-entry zip framing (~1.4 kB seen), the
# metadata, RNG files (~20 kB per rank) and train_state.json. Only for the pre-save space check.
_ENTRY_OVERHEAD_BYTES = 2048
_RANK_OVERHEAD_BYTES = 32 << 10
_FIXED_OVERHEAD_BYTES = 64 << 10
# A rank writes its DCP data as one file per this many bytes, up to MAX_IO_THREADS files written (and hashed as they
# are written) by as many threads; loads verify a rank's share of the files as many at a time.
_BYTES_PER_WRITE_THREAD = 64 << 20
MAX_IO_THREADS = 4


@dataclass
class Space:
    """The pre-save space estimate of one checkpoint."""

    tensor_bytes: int  # tensor data alone: a checkpoint can never be smaller
    needed_bytes: int  # with DCP's framing and the small files: what to make room for
    free_bytes: int | None = None  # on the local disk when the attempt started (None: not a local path)


def estimate(state: dict[str, Any], world: int) -> Space:
    """Bytes one copy of `state` takes (DCP writes a replicated tensor once, a DTensor at its global size)."""
    tensor_bytes, entries, todo = 0, 0, [state]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
            todo.extend(value)
        else:
            entries += 1
            if isinstance(value, torch.Tensor):  # a DTensor counts at its global size
                tensor_bytes += value.numel() * value.element_size()
    overhead = entries * _ENTRY_OVERHEAD_BYTES + world * _RANK_OVERHEAD_BYTES + _FIXED_OVERHEAD_BYTES
    return Space(tensor_bytes, tensor_bytes + overhead)


def write_threads(space: Space, world: int) -> int:
    """Files (and writer threads) per rank for a checkpoint of `space`: one per _BYTES_PER_WRITE_THREAD of a
    rank's share, at least one, at most MAX_IO_THREADS."""
    return max(1, min(MAX_IO_THREADS, space.tensor_bytes // world // _BYTES_PER_WRITE_THREAD))
