"""TEST-ONLY fault injection, for drills and tests that must prove the checks fail when they should.

Faults are read from the environment variable TDEPLOY_TEST_FAULTS (JSON), never
from a deployment spec, so a production spec cannot switch them on. Off unless
that variable is set, and only in a job's first attempt: workers that torchrun
restarts (TORCHELASTIC_RESTART_COUNT > 0) run clean, so a drill can watch the
job recover by itself.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

ENV_VAR = "TDEPLOY_TEST_FAULTS"
log = logging.getLogger(__name__)


class TestFaults(BaseModel):
    """Faults a test can inject into one launch of the trainer."""

    __test__ = False  # not a pytest class
    model_config = ConfigDict(extra="forbid")

    pause_after_step: int | None = Field(
        default=None, description="Every rank stops making progress after this step (a hang to kill)."
    )
    kill_during_save_step: int | None = Field(
        default=None, description="Rank 0 SIGKILLs itself after writing checkpoint data, before committing it."
    )
    crash_at_step: int | None = Field(default=None, description="`crash_rank` raises an exception after this step.")
    crash_rank: int = Field(default=0, ge=0, description="The rank that crashes at crash_at_step.")
    same_samples_as_rank0: int | None = Field(
        default=None, ge=1, description="This rank is fed rank 0's samples (breaks data consistency)."
    )
    seed_offset_rank: int | None = Field(
        default=None, ge=0, description="This rank seeds everything (init, data order) with seed + seed_offset."
    )
    seed_offset: int = Field(default=1, description="Offset added to the seed of seed_offset_rank.")
    slow_rank: int | None = Field(default=None, ge=0, description="This rank sleeps slow_step_s in every step.")
    slow_step_s: float = Field(default=0.2, ge=0, description="Extra compute time per step of slow_rank.")
    checkpoint_without_optimizer: bool = Field(default=False, description="Checkpoints leave the optimizer out.")
    nan_at_step: int | None = Field(default=None, ge=1, description="The loss of this step is NaN on every rank.")
    save_bug_rank: int | None = Field(
        default=None, ge=0, description="This rank raises a TypeError (a bug, not a storage error) inside every save."
    )
    lr_scale: float | None = Field(
        default=None, gt=0, description="Every rank trains with the learning rate (whole schedule) times this."
    )


@functools.cache
def active() -> TestFaults:
    """The faults of this process (none unless TDEPLOY_TEST_FAULTS is set)."""
    raw = os.environ.get(ENV_VAR)
    if not raw or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return TestFaults()
    faults = TestFaults.model_validate_json(raw)
    log.warning("TEST FAULTS ACTIVE (%s): %s", ENV_VAR, faults.model_dump(exclude_none=True))
    return faults


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def seed_for(seed: int) -> int:
    """The seed this rank uses (another one on seed_offset_rank)."""
    faults = active()
    return seed + faults.seed_offset if faults.seed_offset_rank == _rank() else seed


def sample_rank(rank: int) -> int:
    """Whose samples this rank is fed."""
    return 0 if active().same_samples_as_rank0 == rank else rank


def maybe_slow_down() -> None:
    """Sleep inside the compute part of a step on slow_rank."""
    faults = active()
    if faults.slow_rank is not None and faults.slow_rank == _rank():
        time.sleep(faults.slow_step_s)


def loss_poison(step: int) -> float:
    """1.0, or NaN at nan_at_step."""
    return float("nan") if active().nan_at_step == step else 1.0


def maybe_crash(step: int) -> None:
    """Raise on the chosen rank after `step` when asked to."""
    faults = active()
    rank = _rank()
    if faults.crash_at_step == step and faults.crash_rank == rank:
        raise RuntimeError(f"test fault: injected crash on rank {rank} after step {step}")


def maybe_pause(step: int) -> None:
    """Hang forever after `step` when asked to."""
    if active().pause_after_step is not None and step >= active().pause_after_step:
        log.warning("test fault: pausing after step %d", step)
        while True:
            time.sleep(60)


def maybe_kill_during_save(step: int) -> None:
    """Die mid-save (data written, commit marker not) when asked to."""
    if active().kill_during_save_step == step:
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("test fault: SIGKILL during the save of step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)


def maybe_break_save(step: int) -> None:
    """Raise a non-storage error inside the checkpoint save on save_bug_rank."""
    rank = _rank()
    if active().save_bug_rank == rank:
        raise TypeError(f"test fault: a bug inside the checkpoint save of step {step} on rank {rank}")


def scale_lr(optimizer: torch.optim.Optimizer) -> None:
    """Multiply every parameter group's learning rate by lr_scale (call before the scheduler is built)."""
    scale = active().lr_scale
    if scale is not None:
        log.warning("test fault: learning rate x %g", scale)
        for group in optimizer.param_groups:
            group["lr"] *= scale
