"""How the ranks of a save agree: a failure on any rank is judged alike on every rank, over one process group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint.errors import (
    SHORT_WRITE,
    CheckpointAbortedError,
    first_line,
    is_storage_error,
    is_storage_leaf,
    leaves,
    says_no_space,
)


class StorageFailure(RuntimeError):
    """A storage operation failed on some rank during a save (every rank raises it together)."""

    def __init__(self, message: str, no_space: bool = False) -> None:
        super().__init__(message)
        self.no_space = no_space


@dataclass(frozen=True)
class _Outcome:
    """How one rank's operation failed, in a form every rank can judge alike."""

    rank: int
    retryable: bool
    no_space: bool
    message: str


def _outcome(err: BaseException, rank: int, disk_full: Callable[[], bool]) -> _Outcome:
    retryable = is_storage_error(err)
    no_space = retryable and (says_no_space(err) or (SHORT_WRITE in str(err) and disk_full()))
    found = leaves(err, rank)
    culprit = next(((r, e) for r, e in found if not is_storage_leaf(e)), found[0])
    return _Outcome(rank if culprit[0] is None else culprit[0], retryable, no_space, first_line(culprit[1]))


def agree(
    operation: Callable[[], Any],
    disk_full: Callable[[], bool] = lambda: False,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Run a rank-local part of a save so that every rank takes the same decision about its failure.

    Storage errors on any rank raise StorageFailure on every rank (the save is retried); any other
    error is a bug: the rank that has it raises it as itself, the others CheckpointAbortedError.
    The ranks compare notes over `group` (None: the default group).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        result, error = operation(), None
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's exception is a BaseException
        result, error = None, err
    mine = None if error is None else _outcome(error, rank, disk_full)
    failed = [o for o in all_gather(mine, group) if o is not None]
    if not failed:
        return result
    bug = next((o for o in failed if not o.retryable), None)
    if bug is not None:
        if error is not None and mine is not None and not mine.retryable:
            if isinstance(error, CheckpointException):
                raise next(e for _, e in leaves(error) if not is_storage_leaf(e)) from error
            raise error
        raise CheckpointAbortedError(bug.rank, bug.message)
    first = failed[0]
    raise StorageFailure(f"rank {first.rank}: {first.message}", no_space=any(o.no_space for o in failed))


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def all_gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
