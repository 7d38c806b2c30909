"""Drill points: where the production drills (tasks/acceptance/drills.py) stop a job's ranks to strike.

The rank_kill and node_loss drills hold every rank after a step (`StepHold`) and strike while the job still
has steps to run (the storage_outage drill holds twice: before its outage and after the save it failed); the
kill_during_save drill stops every rank at one phase of one checkpoint save (`SavePause`); the hang drill stops
one rank short of a step's collective (`HangPoint`) while the others block in it. Each stopped rank leaves a
marker (`PausedRank`) that the drill waits for. The soak's test plants a memory leak in every rank (`LeakPoint`)
that the soak must catch.

The points are read from the job variable TDEPLOY_DRILL_POINTS (JSON of `DrillPoints`), which only the
drills set, on their own jobs (tasks/launch/environment.py `JobEnvironment`); it is never a spec field,
so a deployment cannot switch a point on. Off unless that variable is set, and only in a job's first
attempt: workers that torchrun restarts (TORCHELASTIC_RESTART_COUNT > 0) run clean, so the drill can watch
the job recover by itself.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from training.watchdog import deliberate_hold

ENV_VAR = "TDEPLOY_DRILL_POINTS"
log = logging.getLogger(__name__)

SavePhase = Literal["writing_dcp", "after_dcp", "after_extras", "after_commit"]
"""The points of a checkpoint save (training/checkpoint/manager.py `CheckpointManager._write`) where a drill can
stop it: while the DCP files are being written (some ranks' files exist, the metadata does not), after every DCP
file, after the small files (RNG, train_state.json) but before COMMIT.json, and right after COMMIT.json."""
SAVE_PHASES: tuple[SavePhase, ...] = get_args(SavePhase)
PAUSE_MARKER_PREFIX = "save-paused-rank-"
HOLD_MARKER_PREFIX = "held-rank-"
HANG_MARKER_PREFIX = "hung-rank-"
RELEASE_FILE = "release"


class SavePause(BaseModel):
    """Every rank stops for good at `phase` of the save of `step` and records it in `marker_dir`.

    The kill_during_save drill sets this on its own jobs, waits for every rank's marker, then SIGKILLs the ranks.
    """

    model_config = ConfigDict(extra="forbid")

    phase: SavePhase = Field(description="Where in the save the ranks stop.")
    step: int = Field(ge=1, description="The step whose checkpoint save is stopped.")
    marker_dir: str = Field(
        description="Local folder (shared by the nodes) where each stopped rank writes save-paused-rank-NNNNN.json."
    )


class StepHold(BaseModel):
    """Every rank waits after `step`, its checkpoints committed, until `marker_dir`/release exists (or
    `timeout_s` passed), having written its marker there.

    The rank_kill and node_loss drills set this on their own first job, wait for every rank's marker, strike,
    then release the survivors: the kill lands while the job still has steps to run, however fast its steps
    are, and a relaunch or elastic restart (which runs without drill points) goes on undisturbed.
    """

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1, description="The step after which the ranks wait.")
    marker_dir: str = Field(
        description="Local folder (shared by the nodes) where each waiting rank writes held-rank-NNNNN.json and "
        "the drill writes `release`."
    )
    timeout_s: float = Field(default=600, gt=0, description="The ranks go on by themselves after this long.")


class HangPoint(BaseModel):
    """Rank `rank` stops progressing at step `step`, just before the step's loss all-reduce, and sleeps until it
    is killed: the other ranks block inside that collective. It records the moment in `marker_dir`.

    The hang drill sets this on its own job: the watchdog (training/watchdog.py) must find the hang in phase
    step, name this rank as the one that did not arrive, and the job's restart must recover it.
    """

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1, description="The step during which the rank stops.")
    rank: int = Field(default=1, ge=0, description="The rank that stops.")
    marker_dir: str = Field(
        description="Local folder (shared by the nodes) where the stopped rank writes hung-rank-NNNNN.json."
    )


class PausedRank(BaseModel):
    """The marker a rank stopped by SavePause (or held by StepHold: phase "held") leaves: who, where, and at
    which point of which save."""

    rank: int
    host: str
    pid: int
    phase: SavePhase | Literal["held", "hung"]
    step: int
    time_unix_s: float


class NanLossPoint(BaseModel):
    """Every rank's training loss of `step` becomes NaN: a workload error (the workload_error drill's job), which
    the trainer must stop on and the restart policy must not retry."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1, description="The step whose loss becomes NaN.")


class LeakPoint(BaseModel):
    """Every rank keeps `mb_per_step` more memory after each step: a planted leak that the soak
    (tasks/soak/memory.py) must find in the ranks' memory growth."""

    model_config = ConfigDict(extra="forbid")

    mb_per_step: float = Field(gt=0, le=1024, description="MiB kept per step.")


class DrillPoints(BaseModel):
    """The drill points of one job (TDEPLOY_DRILL_POINTS); none by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hold_after_step: StepHold | None = Field(
        default=None, description="Every rank waits after this step until the drill releases it (rank_kill, node_loss)."
    )
    hold_again_after_step: StepHold | None = Field(
        default=None,
        description="A second hold, at a later step and released apart (its own marker folder): the storage_outage "
        "drill's ranks wait once before its outage and once after the save it made fail.",
    )
    pause_in_save: SavePause | None = Field(
        default=None, description="Every rank stops at this point of one save (the kill_during_save drill's jobs)."
    )
    hang_in_step: HangPoint | None = Field(
        default=None, description="One rank stops before a collective of one step (the hang drill's job)."
    )
    nan_loss: NanLossPoint | None = Field(
        default=None, description="The loss of one step becomes NaN on every rank (the workload_error drill's job)."
    )
    leak_memory: LeakPoint | None = Field(
        default=None, description="Every rank keeps more memory after each step (the soak's planted leak)."
    )


@functools.cache
def active() -> DrillPoints:
    """The drill points of this process (none unless TDEPLOY_DRILL_POINTS is set, and none after a restart)."""
    raw = os.environ.get(ENV_VAR)
    if not raw or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return DrillPoints()
    points = DrillPoints.model_validate_json(raw)
    log.warning("drill points set (%s): %s", ENV_VAR, points.model_dump(exclude_none=True))
    return points


def _rank() -> int:
    # The spec reads this module's phases, so torch is not imported here. A process whose torch is not loaded
    # yet has no process group either: it is rank 0 without paying torch's import inside a timed hold.
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _hold_at(step: int) -> StepHold | None:
    """The job's StepHold after `step` (the first or the second), if any."""
    points = active()
    return next((h for h in (points.hold_after_step, points.hold_again_after_step) if h and h.step == step), None)


def holds_after(step: int) -> bool:
    """Whether this rank waits for the drill's release after `step` (see StepHold)."""
    return _hold_at(step) is not None


def poisons_loss(step: int) -> bool:
    """Whether this rank's loss of `step` becomes NaN (see NanLossPoint)."""
    point = active().nan_loss
    return point is not None and point.step == step


_leaked: list[bytearray] = []


def leak() -> None:
    """Keep the job's LeakPoint's share of memory for good (touched, so it counts in the RSS); nothing without one."""
    point = active().leak_memory
    if point is not None:
        _leaked.append(bytearray(b"\x5a") * int(point.mb_per_step * 2**20))


def hold(step: int) -> None:
    """Write this rank's marker and wait until the drill releases the job (or the hold's timeout passes)."""
    spec = _hold_at(step)
    assert spec is not None
    rank = _leave_marker(spec.marker_dir, HOLD_MARKER_PREFIX, "held", step)
    log.warning("drill point: rank %d holds after step %d until the drill releases it", rank, step)
    release = os.path.join(spec.marker_dir, RELEASE_FILE)
    deadline = time.monotonic() + spec.timeout_s
    with deliberate_hold(f"drill hold after step {step}"):  # waiting for the drill is no hang
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)


def pauses_a_save() -> bool:
    """Whether a drill may stop one of this job's saves (see SavePause)."""
    return active().pause_in_save is not None


def at_save_phase(phase: SavePhase, step: int, shard_written: bool | None = None) -> None:
    """Stop this rank for good at `phase` of the save of `step` when the job's SavePause names it (the drill
    kills it); otherwise return at once.

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
    log.warning("drill point: rank %d stopped at save phase %s of step %d", rank, phase, step)
    with deliberate_hold(f"drill pause at save phase {phase} of step {step}"):  # the drill kills it: no hang
        while True:
            time.sleep(60)


def before_collective(step: int) -> None:
    """Stop this rank for good before the loss all-reduce of `step` when the job's HangPoint names it and the
    step (its marker records when); otherwise return at once."""
    point = active().hang_in_step
    if point is None or point.step != step or point.rank != _rank():
        return
    _leave_marker(point.marker_dir, HANG_MARKER_PREFIX, "hung", step)
    log.warning("drill point: rank %d stops progressing in step %d, before its loss all-reduce", point.rank, step)
    while True:
        time.sleep(60)


def _leave_marker(marker_dir: str, prefix: str, phase: SavePhase | Literal["held", "hung"], step: int) -> int:
    """Write this rank's PausedRank marker `prefix`NNNNN.json into `marker_dir`; returns the rank."""
    rank = _rank()
    marker = PausedRank(
        rank=rank, host=os.uname().nodename, pid=os.getpid(), phase=phase, step=step, time_unix_s=time.time()
    )
    os.makedirs(marker_dir, exist_ok=True)
    path = os.path.join(marker_dir, f"{prefix}{rank:05d}.json")
    partial = f"{path}.{os.getpid()}.tmp"  # replica groups: each group has a rank 0, writing the same marker
    with open(partial, "w") as handle:
        handle.write(marker.model_dump_json())
    os.replace(partial, path)  # whole or absent: the drill never reads half a marker
    return rank


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
