"""The bugs a test can ask for (TestFaults) and the job variable that carries them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

ENV_VAR = "TDEPLOY_TEST_FAULTS"


class TestFaults(BaseModel):
    """Bugs a test can inject into one launch of the trainer."""

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
    slow_rank: int | None = Field(
        default=None,
        ge=0,
        description="This rank sleeps slow_step_s in every step (waiting, which costs no CPU time: it slows the job "
        "but the straggler rule, judged on CPU time, does not see it), or computes longer with slow_factor.",
    )
    slow_step_s: float = Field(default=0.2, ge=0, description="Extra compute time per step of slow_rank.")
    slow_data_s: float | None = Field(
        default=None,
        gt=0,
        description="Every rank's data loader sleeps this long per batch it reads (an idle input pipeline: the "
        "resource gate's compute share must trip on it).",
    )
    checkpoint_without_optimizer: bool = Field(default=False, description="Checkpoints leave the optimizer out.")
    nan_at_step: int | None = Field(default=None, ge=1, description="The loss of this step is NaN on every rank.")
    save_bug_rank: int | None = Field(
        default=None, ge=0, description="This rank raises a TypeError (a bug, not a storage error) inside every save."
    )
    lr_scale: float | None = Field(
        default=None, gt=0, description="Every rank trains with the learning rate (whole schedule) times this."
    )
    sampler_skip_index: int | None = Field(
        default=None,
        ge=0,
        description="The sampler never hands out this sample: the next index takes its place (breaks coverage).",
    )
    accum_bug: bool = Field(
        default=False,
        description="Gradients are zeroed before every micro-batch, so only the last one of a step counts "
        "(a gradient-accumulation bug in the trainer's step).",
    )
    commit_before_extras: bool = Field(
        default=False,
        description="A save writes COMMIT.json right after the DCP files (listing only those), then the RNG files "
        "and train_state.json: the commit marker early (a broken save protocol for the drill to catch).",
    )
    skip_grad_sync: bool = Field(
        default=False, description="DDP never synchronises gradients (each rank trains on its own)."
    )
    tp_shard_seed: bool = Field(
        default=False,
        description="Tensor-parallel rank 1 of every TP group initialises its shards with another seed "
        "(seed_offset), so the sharded matrices are not slices of one model (a broken TP init).",
    )
    slow_factor: float | None = Field(
        default=None,
        gt=1,
        description="slow_rank computes this many times as long as it would: it busy-loops (factor - 1) x its own "
        "compute time per step (CPU time on CPU, of its last steps; instead of slow_step_s's sleep), so the "
        "slowness is relative and is compute, as a slower core's would be, not waiting.",
    )
