"""TEST-ONLY fault injection, for drills and tests that must prove the checks fail when they should.

Faults are read from the environment variable TDEPLOY_TEST_FAULTS (JSON), never
from a deployment spec, so a production spec cannot switch them on. Off unless
that variable is set, and only in a job's first attempt: workers that torchrun
restarts (TORCHELASTIC_RESTART_COUNT > 0) run clean, so a drill can watch the
job recover by itself.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import statistics
import time
from typing import Literal, get_args

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from training import preemption

ENV_VAR = "TDEPLOY_TEST_FAULTS"
log = logging.getLogger(__name__)

SavePhase = Literal["writing_dcp", "after_dcp", "after_extras", "after_commit"]
"""The points of a checkpoint save (training/checkpoint.py `CheckpointManager._write`) where a drill can stop it:
while the DCP files are being written (some ranks' files exist, the metadata does not), after every DCP file,
after the small files (RNG, train_state.json) but before COMMIT.json, and right after COMMIT.json."""
SAVE_PHASES: tuple[SavePhase, ...] = get_args(SavePhase)
PAUSE_MARKER_PREFIX = "save-paused-rank-"


class SavePause(BaseModel):
    """Every rank stops for good at `phase` of the save of `step` and records it in `marker_dir`.

    The kill_during_save drill sets this on its own jobs only (through the job's fault variable, never a
    spec field: a spec cannot set it), waits for every rank's marker, then SIGKILLs the ranks.
    """

    model_config = ConfigDict(extra="forbid")

    phase: SavePhase = Field(description="Where in the save the ranks stop.")
    step: int = Field(ge=1, description="The step whose checkpoint save is stopped.")
    marker_dir: str = Field(
        description="Local folder (shared by the nodes) where each stopped rank writes save-paused-rank-NNNNN.json."
    )


HOLD_MARKER_PREFIX = "held-rank-"
RELEASE_FILE = "release"


class StepHold(BaseModel):
    """Every rank waits after `step`, its checkpoints committed, until `marker_dir`/release exists (or
    `timeout_s` passed), having written its marker there.

    The rank_kill and node_loss drills set this on their own first job (through the job's fault variable,
    never a spec field), wait for every rank's marker, strike, then release the survivors: the kill lands
    while the job still has steps to run, however fast its steps are, and a relaunch or elastic restart
    (which runs without faults) goes on undisturbed.
    """

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1, description="The step after which the ranks wait.")
    marker_dir: str = Field(
        description="Local folder (shared by the nodes) where each waiting rank writes held-rank-NNNNN.json and "
        "the drill writes `release`."
    )
    timeout_s: float = Field(default=600, gt=0, description="The ranks go on by themselves after this long.")


class PausedRank(BaseModel):
    """The marker a rank stopped by SavePause (or held by StepHold: phase "held") leaves: who, where, and at
    which point of which save."""

    rank: int
    host: str
    pid: int
    phase: SavePhase | Literal["held"]
    step: int
    time_unix_s: float


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
    slow_rank: int | None = Field(
        default=None,
        ge=0,
        description="This rank sleeps slow_step_s in every step (waiting, which costs no CPU time: it slows the job "
        "but the straggler rule, judged on CPU time, does not see it), or computes longer with slow_factor.",
    )
    slow_step_s: float = Field(default=0.2, ge=0, description="Extra compute time per step of slow_rank.")
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
    pause_in_save: SavePause | None = Field(
        default=None, description="Every rank stops at this point of one save (the kill_during_save drill's jobs)."
    )
    hold_after_step: StepHold | None = Field(
        default=None, description="Every rank waits after this step until the drill releases it (rank_kill, node_loss)."
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


def tp_shard_seed_offset(tp_coordinate: int) -> int:
    """What tp_shard_seed adds to the init seed of a rank at `tp_coordinate` of its tensor-parallel group: 0, or
    seed_offset on coordinate 1."""
    return active().seed_offset if active().tp_shard_seed and tp_coordinate == 1 else 0


@torch.no_grad()
def maybe_reseed_tp_shards(model: torch.nn.Module, tp_coordinate: int, seed: int) -> int:
    """With tp_shard_seed, redraw this rank's local shard of every parameter sharded over the "tp" mesh
    dimension from seed + tp_shard_seed_offset (same mean and spread, other values); the number redrawn.

    Call it after the model is parallelised (parallelize_module, fully_shard): the DTensors are distributed
    from one rank's full weights, so seeding the init alone would not reach the shards.
    """
    offset = tp_shard_seed_offset(tp_coordinate)
    if not offset:
        return 0
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415 - model-parallel jobs only

    generator = torch.Generator(device="cpu").manual_seed(seed + offset)
    redrawn = 0
    for param in model.parameters():
        if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
            continue
        if not isinstance(param.placements[param.device_mesh.mesh_dim_names.index("tp")], Shard):
            continue
        local = param.to_local()
        if local.numel() < 2:
            continue
        mean, std = local.float().mean().item(), local.float().std().item()
        fresh = torch.randn(local.shape, generator=generator) * (std or 0.02) + mean
        local.copy_(fresh.to(device=local.device, dtype=local.dtype))
        redrawn += 1
    log.warning("test fault: tensor-parallel rank %d redrew %d shards with seed %d", tp_coordinate, redrawn,
                seed + offset)  # fmt: skip
    return redrawn


def sample_rank(rank: int) -> int:
    """Whose samples this rank is fed."""
    return 0 if active().same_samples_as_rank0 == rank else rank


def sample_order(order: np.ndarray) -> np.ndarray:
    """An epoch's sample order; with sampler_skip_index, that sample is replaced by the next index (seen twice)."""
    skip = active().sampler_skip_index
    if skip is None or skip >= len(order):
        return order
    return np.where(order == skip, (skip + 1) % len(order), order)


class _SlowDown:
    """slow_rank's own compute times of its recent steps (the slow-down taken out), what it added in this one, and
    whether those times are CPU time (the busy loop then runs by the process's CPU clock)."""

    def __init__(self) -> None:
        self.own_compute_s: collections.deque[float] = collections.deque(maxlen=5)
        self.slept_s = 0.0
        self.cpu_clock = False


_slow_down = _SlowDown()


def busy_loop(seconds: float, cpu_clock: bool) -> None:
    """Compute (spin) for `seconds` of this process's CPU time, or of wall time with `cpu_clock` False."""
    clock = time.process_time if cpu_clock else time.perf_counter
    end = clock() + seconds
    while clock() < end:
        pass


def maybe_slow_down() -> None:
    """Slow slow_rank down inside the compute part of a step: sleep slow_step_s, or with slow_factor busy-loop
    (factor - 1) x its own compute time per step (the median of its last 5 steps, so one busy step does not double
    the next; nothing in its first step; see `step_computed`)."""
    faults = active()
    if faults.slow_rank is None or faults.slow_rank != _rank():
        return
    if faults.slow_factor is None:
        _slow_down.slept_s = 0.0 if _slow_down.cpu_clock else faults.slow_step_s  # a sleep costs no CPU time
        time.sleep(faults.slow_step_s)
        return
    own = _slow_down.own_compute_s
    seconds = (faults.slow_factor - 1) * statistics.median(own) if own else 0.0
    _slow_down.slept_s = seconds
    busy_loop(seconds, _slow_down.cpu_clock)


def step_computed(compute_s: float, cpu_clock: bool = False) -> None:
    """Note this rank's compute time of the step that ended (CPU time with `cpu_clock`), for slow_factor (what
    maybe_slow_down added taken out)."""
    _slow_down.own_compute_s.append(max(0.0, compute_s - _slow_down.slept_s))
    _slow_down.slept_s = 0.0
    _slow_down.cpu_clock = cpu_clock


def loss_poison(step: int) -> float:
    """1.0, or NaN at nan_at_step."""
    return float("nan") if active().nan_at_step == step else 1.0


def maybe_crash(step: int) -> None:
    """Raise on the chosen rank after `step` when asked to."""
    faults = active()
    rank = _rank()
    if faults.crash_at_step == step and faults.crash_rank == rank:
        raise RuntimeError(f"test fault: injected crash on rank {rank} after step {step}")


def stops_after(step: int) -> bool:
    """Whether an injected crash or pause ends (some rank of) the run after `step`: its records are written first,
    as a healthy run's would be by then."""
    faults = active()
    pause = faults.pause_after_step
    return faults.crash_at_step == step or (pause is not None and step >= pause) or holds_after(step)


def holds_after(step: int) -> bool:
    """Whether this rank waits for the drill's release after `step` (see StepHold)."""
    hold = active().hold_after_step
    return hold is not None and hold.step == step


def hold(step: int) -> None:
    """Write this rank's marker and wait until the drill releases the job (or the hold's timeout passes)."""
    spec = active().hold_after_step
    assert spec is not None and spec.step == step
    rank = _leave_marker(spec.marker_dir, HOLD_MARKER_PREFIX, "held", step)
    log.warning("test fault: rank %d holds after step %d until the drill releases it", rank, step)
    release = os.path.join(spec.marker_dir, RELEASE_FILE)
    deadline = time.monotonic() + spec.timeout_s
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)


def _leave_marker(marker_dir: str, prefix: str, phase: SavePhase | Literal["held"], step: int) -> int:
    """Write this rank's PausedRank marker `prefix`NNNNN.json into `marker_dir`; returns the rank."""
    rank = _rank()
    marker = PausedRank(
        rank=rank, host=os.uname().nodename, pid=os.getpid(), phase=phase, step=step, time_unix_s=time.time()
    )
    os.makedirs(marker_dir, exist_ok=True)
    path = os.path.join(marker_dir, f"{prefix}{rank:05d}.json")
    with open(f"{path}.tmp", "w") as handle:
        handle.write(marker.model_dump_json())
    os.replace(f"{path}.tmp", path)  # whole or absent: the drill never reads half a marker
    return rank


def maybe_pause(step: int) -> None:
    """Hang forever after `step` when asked to (a hang to kill: SIGTERM ends it at once, with no checkpoint)."""
    if active().pause_after_step is not None and step >= active().pause_after_step:
        log.warning("test fault: pausing after step %d", step)
        preemption.WATCH.uninstall()
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


def at_save_phase(phase: SavePhase, step: int, shard_written: bool | None = None) -> None:
    """Stop this rank for good at `phase` of the save of `step` when pause_in_save asks for it (a drill kills it).

    At "writing_dcp" (called before and after this rank writes its DCP files, `shard_written` False then True)
    rank 0 stops once its files are written and every other rank before writing, so the step folder holds
    some of the DCP data and no metadata.
    """
    pause = active().pause_in_save
    if pause is None or pause.phase != phase or pause.step != step:
        return
    rank = _rank()
    if phase == "writing_dcp" and shard_written != (rank == 0):
        return
    _leave_marker(pause.marker_dir, PAUSE_MARKER_PREFIX, phase, step)
    log.warning("test fault: rank %d stopped at save phase %s of step %d", rank, phase, step)
    while True:
        time.sleep(60)


def paused_ranks(marker_dir: str, prefix: str = PAUSE_MARKER_PREFIX) -> list[PausedRank]:
    """The ranks that have stopped at a save phase (or, with HOLD_MARKER_PREFIX, hold after a step) and left
    their marker in `marker_dir`, by rank."""
    if not os.path.isdir(marker_dir):
        return []
    names = sorted(n for n in os.listdir(marker_dir) if n.startswith(prefix) and n.endswith(".json"))
    markers = []
    for name in names:
        with open(os.path.join(marker_dir, name)) as handle:
            markers.append(PausedRank.model_validate_json(handle.read()))
    return markers


def with_faults(variables: dict[str, str] | None, **fields: object) -> dict[str, str]:
    """The job fault variables `variables` with `fields` of TestFaults set (for a drill's own job)."""
    found = dict(variables or {})
    current = TestFaults.model_validate_json(found[ENV_VAR]) if ENV_VAR in found else TestFaults()
    merged = TestFaults.model_validate({**current.model_dump(exclude_defaults=True), **fields})
    return {**found, ENV_VAR: merged.model_dump_json(exclude_defaults=True)}
