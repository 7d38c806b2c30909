"""Hang detection per phase: a watchdog thread per rank, per-rank heartbeats, and the hang record.

The trainer tells the watchdog which phase it is in (`Watchdog.phase("step", n)`, "save", "eval"; "startup" runs
from the rendezvous to the end of the first step) and marks the points inside a phase where the ranks meet
(`Watchdog.beat("loss_sync")` just before the step's loss all-reduce). Each phase has its own timeout
(training/config.py `WatchdogConfig`); the step's default is derived from the job's own measured steps
(`StepTimeout`). Time is wall time: a hung rank burns no CPU, and a busy machine's slower steps widen the
tolerance through the measured steps, not through a guess. A deliberate wait (a drill point's hold or pause,
`deliberate_hold`) stops the clock of the phase it falls in: it is no hang.

Every phase entry and point is written as this rank's heartbeat, `<output>/heartbeats/rank-NNNNN.json` (one
pwrite in place with a CRC, `HeartbeatFile`), when run.output_url is a local or shared folder. All ranks run the same phases
and points in the same order, so each heartbeat's sequence number says how far that rank got: the ranks behind
the others are the ones that did not arrive.

When a phase outlives its timeout, the rank
1. marks the hang for its peers (`hangs/attempt-A.detected`): each of them dumps its stacks too;
2. dumps the stacks of every thread (faulthandler) into `<output>/hangs/rank-NNNNN-attemptA.txt`, and the
   collective flight recorder (torch's, which records gloo and NCCL collectives when TORCH_FR_BUFFER_SIZE is set:
   `enable_flight_recorder`) into `rank-NNNNN-attemptA.fr.json`;
3. appends a `HangRecord` to `<output>/hangs.jsonl` (phase, step, elapsed, timeout, the ranks that did not arrive);
4. logs one line, waits briefly for every rank's stacks, and exits with HANG_EXIT_CODE, so that torchrun
   restarts the job (cluster.max_restarts) and the restart policy classifies the failure as a hang.
A hang inside a C call that holds the GIL starves this thread; faulthandler's C-level timer, armed per phase
BACKSTOP_AFTER_S past its timeout, then dumps every thread's stack to stderr (the job log) and exits 1.

This module writes and reads those files; nobody else spells their names.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from training.config import WatchdogConfig
from training.storage import is_local, local_path

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 86
"""A rank's exit code after its watchdog found a hang (neither a sysexits code, nor 128 + a signal, nor
PREEMPTED_EXIT_CODE): the launchers' restart policy reads it as an infrastructure failure of kind "hang"."""
HANGS_FILE = "hangs.jsonl"
HANGS_DIR = "hangs"
HEARTBEATS_DIR = "heartbeats"
HEARTBEAT_BYTES = 1024
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_FLIGHT_RECORDER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = 2000
POLL_S = 0.1
"""How often the watchdog thread looks at the phase clock and for a peer's hang mark."""
STACKS_GRACE_S = 5.0
"""How long a rank that found a hang waits for every rank's stacks before it exits (its exit ends the job's
collectives, and with them the peers' chance to dump theirs)."""
BACKSTOP_AFTER_S = 60.0
"""A phase still running this long after its timeout means the watchdog thread itself cannot run (a C call holds
the GIL): faulthandler's own C thread then dumps every thread's stack to stderr (the job log) and exits 1."""

Phase = Literal["startup", "step", "save", "eval"]
_RUNNING: Watchdog | None = None
"""The watchdog this worker process started (`Watchdog.start`): the one `deliberate_hold` holds."""


def rank_file(rank: int) -> str:
    """rank-NNNNN (the per-rank name of every file here)."""
    return f"rank-{rank:05d}"


def stacks_name(rank: int, attempt: int) -> str:
    """The stack dump's file name of `rank` in `attempt` (under hangs/)."""
    return f"{rank_file(rank)}-attempt{attempt}.txt"


def enable_flight_recorder() -> None:
    """Ask torch to record the recent collectives of the process groups created from now on (gloo and NCCL):
    the hang dump then says which collective each rank reached. Call before init_process_group; a value the
    user set is kept."""
    for name in (FLIGHT_RECORDER_ENV, NCCL_FLIGHT_RECORDER_ENV):  # torch's generic recorder, and NCCL's own
        os.environ.setdefault(name, str(FLIGHT_RECORDER_ENTRIES))


# ---- heartbeats -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heartbeat:
    """Where one rank was last seen: its `seq`-th phase entry or point of `attempt` of job `run_id`."""

    rank: int
    attempt: int
    seq: int
    phase: str
    step: int
    point: str
    time_unix_s: float
    host: str = ""
    pid: int = 0
    run_id: str = ""
    """TORCHELASTIC_RUN_ID: a requeued job writing into the same folder does not read an earlier job's beats."""

    def where(self) -> str:
        """`phase step at step 7 (loss_sync)`."""
        return f"phase {self.phase} at step {self.step} ({self.point})"


class HeartbeatFile:
    """One rank's heartbeat file, kept open and overwritten in place: a JSON line and its CRC-32, padded to
    HEARTBEAT_BYTES, in one pwrite (a write-and-rename per beat measured 0.8 ms on this busy CPU machine, this 45 us). A reader
    that catches a write half done sees a CRC that does not match and reads again."""

    def __init__(self, output_dir: Path, rank: int) -> None:
        path = output_dir / HEARTBEATS_DIR / f"{rank_file(rank)}.json"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def write(self, beat: Heartbeat) -> None:
        """Replace the file's content with `beat`."""
        line = json.dumps(asdict(beat)).encode()
        os.pwrite(self.fd, f"{line.decode()}\n{zlib.crc32(line):08x}\n".encode().ljust(HEARTBEAT_BYTES), 0)

    def close(self) -> None:
        """Close the file (it stays, with the last beat)."""
        os.close(self.fd)


def write_heartbeat(output_dir: Path, beat: Heartbeat) -> None:
    """Write `beat` as its rank's heartbeat (once; a watchdog keeps a HeartbeatFile open instead)."""
    (output_dir / HEARTBEATS_DIR).mkdir(parents=True, exist_ok=True)
    heartbeat = HeartbeatFile(output_dir, beat.rank)
    heartbeat.write(beat)
    heartbeat.close()


def _read_heartbeat(path: Path) -> Heartbeat | None:
    """The heartbeat in `path`, read again while a write is caught half done; None when it is not one."""
    for _ in range(5):
        line, _, rest = path.read_bytes().partition(b"\n")
        if rest[:8] == f"{zlib.crc32(line):08x}".encode():
            try:
                return Heartbeat(**json.loads(line))
            except (ValueError, TypeError):
                return None
        time.sleep(0.001)
    return None


def read_heartbeats(output_dir: Path | str) -> dict[int, Heartbeat]:
    """Every rank's last heartbeat in the run folder, by rank (any attempt)."""
    folder = Path(output_dir) / HEARTBEATS_DIR
    beats = {}
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        beat = _read_heartbeat(path)
        if beat is not None:
            beats[beat.rank] = beat
    return beats


@dataclass(frozen=True)
class Arrival:
    """Who did not arrive: the ranks whose heartbeat is behind the furthest one (or missing), and the rest."""

    late_ranks: list[int]
    waiting_ranks: list[int]
    message: str


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def judge_arrival(beats: dict[int, Heartbeat], world_size: int, attempt: int, run_id: str = "") -> Arrival:
    """The ranks that did not arrive where the others are, from this attempt's heartbeats, in words:
    "rank 1 did not arrive: last seen in phase step at step 8 (start); rank 0 waits in phase step at step 8
    (loss_sync)". Every rank runs the same phases and points in the same order, so a lower sequence number is a
    rank behind; a rank without a heartbeat in this attempt never got as far as the first one."""
    current = {r: b for r, b in beats.items() if (b.attempt, b.run_id) == (attempt, run_id) and r < world_size}
    if not current:
        return Arrival([], [], "no heartbeat in this attempt (heartbeats need a local or shared run.output_url)")
    furthest = max(b.seq for b in current.values())
    late = sorted(r for r in range(world_size) if r not in current or current[r].seq < furthest)
    waiting = sorted(r for r, b in current.items() if b.seq == furthest)
    ahead = current[waiting[0]]
    if not late:
        return Arrival([], waiting, f"no rank is behind: all {world_size} wait in {ahead.where()}")
    seen = {}
    for r in late:
        seen.setdefault(current[r].where() if r in current else "nowhere: no heartbeat in this attempt", []).append(r)
    parts = [
        f"{_ranks_text(ranks)} did not arrive: last seen in {where}" if not where.startswith("nowhere") else
        f"{_ranks_text(ranks)} did not arrive: {where.removeprefix('nowhere: ')}"
        for where, ranks in seen.items()
    ]  # fmt: skip
    verb = "waits" if len(waiting) == 1 else "wait"
    message = f"{'; '.join(parts)}; {_ranks_text(waiting)} {verb} in {ahead.where()}"
    hosts = {b.host for b in current.values()}
    if len(current) < world_size and len(hosts) == 1:  # a node-local folder shows only this node's ranks
        message += f" (only host {hosts.pop()}'s heartbeats are visible: is run.output_url shared by the nodes?)"
    return Arrival(late, waiting, message)


# ---- the auto step timeout --------------------------------------------------------------------------------


class StepTimeout:
    """The step phase's timeout: step_timeout_s when set, else max(floor, factor x the slowest of the recent
    steps) from this job's own measured steps (wall time, so a busy machine's spikes widen it as they happen)."""

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.step_timeout_window_steps)

    def observe(self, seconds: float) -> None:
        """One finished step's wall time."""
        self.recent.append(seconds)

    def seconds(self) -> float:
        """The timeout of the next step."""
        if self.cfg.step_timeout_s is not None:
            return self.cfg.step_timeout_s
        slowest = max(self.recent, default=0.0)
        return max(self.cfg.step_timeout_floor_s, self.cfg.step_timeout_factor * slowest)

    def rule(self) -> str:
        """How the current timeout was set, in words (for the hang record)."""
        if self.cfg.step_timeout_s is not None:
            return f"watchdog.step_timeout_s={self.cfg.step_timeout_s:g}"
        slowest = max(self.recent, default=0.0)
        return (
            f"auto: max(floor {self.cfg.step_timeout_floor_s:g}s, {self.cfg.step_timeout_factor:g} x the slowest "
            f"of the last {len(self.recent)} steps {slowest:.3g}s)"
        )


# ---- the hang record --------------------------------------------------------------------------------------


@dataclass
class HangRecord:
    """One rank's account of a hang (a line of hangs.jsonl)."""

    time_unix_s: float
    attempt: int
    rank: int
    host: str
    pid: int
    phase: str
    step: int
    point: str
    elapsed_s: float
    timeout_s: float
    timeout_rule: str
    detected_by: str
    """"timeout" (this rank's own phase clock) or "rank N" (a peer found it first; this rank dumped its stacks)."""
    late_ranks: list[int]
    waiting_ranks: list[int]
    message: str
    stacks: str
    flight_recorder: str | None = None
    last_collective_seq: int | None = None
    """The flight recorder's last collective of this rank's default group (None: not recorded)."""
    late_since_unix_s: float | None = None
    """The newest heartbeat time among the late ranks: when they were last seen (None: none has one)."""
    run_id: str = ""
    """TORCHELASTIC_RUN_ID of the job (stack dumps are named by rank and attempt: a later job's replace them)."""
    format_version: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: what hung, where, and who did not arrive."""
        return (
            f"hang on rank {self.rank} (attempt {self.attempt}): {self.phase} at step {self.step} ran "
            f"{self.elapsed_s:.1f}s > {self.timeout_s:.1f}s ({self.timeout_rule}); {self.message}; stacks: {self.stacks}"
        )


def hang_records(output_dir: Path | str) -> list[HangRecord]:
    """Every hang record of a run folder, in the order written ([] when none)."""
    path = Path(output_dir) / HANGS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            records.append(HangRecord(**json.loads(line)))
    return records


def stack_dumps(output_dir: Path | str, attempt: int) -> dict[int, Path]:
    """The stack dump of each rank that wrote one in `attempt`, by rank."""
    folder = Path(output_dir) / HANGS_DIR
    found = {}
    for path in sorted(folder.glob(f"rank-*-attempt{attempt}.txt")) if folder.is_dir() else []:
        found[int(path.name.split("-")[1])] = path
    return found


def _append_record(output_dir: Path, record: HangRecord) -> None:
    """One line, one write (O_APPEND): the ranks' records do not interleave."""
    line = (json.dumps(asdict(record)) + "\n").encode()
    fd = os.open(output_dir / HANGS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def dump_flight_recorder(path: Path) -> int | None:
    """Write torch's collective flight recorder (JSON) to `path`; the last collective sequence number of the
    default group, or None where this torch records nothing (no buffer size set, or no such API).

    NCCL process groups keep their own recorder (`_dump_nccl_trace_json`, with the communicators' state); gloo's
    goes to the generic one (`_dump_fr_trace_json`, torch >= 2.13), which is what runs on this project's CPU
    test machines: the NCCL branch is written to torch's API but not exercised without GPUs."""
    import torch  # noqa: PLC0415 - only a rank that hangs pays for reaching into torch's C extension
    import torch.distributed as dist  # noqa: PLC0415

    size = os.environ.get(FLIGHT_RECORDER_ENV) or os.environ.get(NCCL_FLIGHT_RECORDER_ENV) or "0"
    if not int(size):
        return None
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json") if nccl else ("_dump_fr_trace_json",)
    dump = next((getattr(c10d, name) for name in names if hasattr(c10d, name)), None)
    if dump is None:
        return None
    raw = dump()
    path.write_bytes(raw)
    entries = json.loads(raw).get("entries") or []
    seqs = [e.get("collective_seq_id", 0) for e in entries if e.get("pg_id") in (0, "0")]
    return max(seqs, default=None)


# ---- the watchdog -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Active:
    phase: str
    step: int
    point: str
    since: float
    timeout_s: float | None
    rule: str


@dataclass(frozen=True)
class Expiry:
    """A phase that ran past its timeout."""

    phase: str
    step: int
    point: str
    elapsed_s: float
    timeout_s: float
    rule: str


class Watchdog:
    """The per-rank hang watchdog: phase clocks, heartbeats, and the hang dump. `start` begins the start-up
    phase and the thread; without `start` (in-process use, tests) it tracks phases and never acts."""

    def __init__(
        self,
        cfg: WatchdogConfig,
        rank: int = 0,
        world_size: int = 1,
        output_dir: Path | None = None,
        attempt: int = 0,
        clock: Callable[[], float] = time.monotonic,
        run_id: str = "",
    ) -> None:
        self.cfg, self.rank, self.world_size, self.attempt = cfg, rank, world_size, attempt
        self.run_id = run_id
        self.output_dir = output_dir if cfg.enabled else None
        self.clock = clock
        self.steps = StepTimeout(cfg)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._active: _Active | None = None
        self._startup_open = False
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Deliberate holds (`held`, from any thread): phase clocks run on `_now`, the clock less the time held.
        self._holds, self._hold_since, self._held_s = 0, None, 0.0
        self._hold_lock = threading.Lock()
        self._heartbeat: HeartbeatFile | None = None
        if self.output_dir is not None:
            (self.output_dir / HEARTBEATS_DIR).mkdir(parents=True, exist_ok=True)
            self._heartbeat = HeartbeatFile(self.output_dir, rank)

    @classmethod
    def for_rank(cls, cfg: WatchdogConfig, rank: int, world_size: int, output_url: str) -> Watchdog:
        """This worker's watchdog (its attempt from TORCHELASTIC_RESTART_COUNT), started: the start-up phase runs.
        Heartbeats and dumps go to run.output_url when it is a local or shared folder; else the stacks go to
        stderr and no rank can be named."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        output_dir = Path(local_path(output_url)) if is_local(output_url) else None
        dog = cls(cfg, rank, world_size, output_dir, attempt, run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""))
        dog.start()
        return dog

    # -- what the trainer calls --

    def start(self) -> None:
        """Enter the start-up phase (the rendezvous is done) and start the thread when enabled."""
        self._startup_open = True
        self._enter(_Active("startup", 0, "rendezvous", self._now(), self.cfg.startup_timeout_s,
                            f"watchdog.startup_timeout_s={self.cfg.startup_timeout_s}"))  # fmt: skip
        if self.cfg.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="tdeploy-watchdog", daemon=True)
            self._thread.start()
            global _RUNNING  # noqa: PLW0603 - one watchdog per worker process; drill points hold it (deliberate_hold)
            _RUNNING = self
        self._arm_backstop()

    @contextlib.contextmanager
    def phase(self, name: Phase, step: int) -> Iterator[None]:
        """Time `name` at `step` against its timeout; the first step belongs to start-up (its clock goes on)."""
        previous, now = self._active, self._now()
        first_step = name == "step" and self._startup_open
        if first_step:
            assert previous is not None
            active = _Active("startup", step, "first_step", previous.since, previous.timeout_s, previous.rule)
        elif name == "step":
            active = _Active("step", step, "start", now, self.steps.seconds(), self.steps.rule())
        else:
            timeout = self.cfg.save_timeout_s if name == "save" else self.cfg.eval_timeout_s
            active = _Active(name, step, "start", now, timeout, f"watchdog.{name}_timeout_s={timeout}")
        self._enter(active)
        self._arm_backstop()
        try:
            yield
        finally:
            if name == "step":  # (a deliberate hold inside the step is no part of its time)
                self.steps.observe(self._now() - now)
            if first_step:
                self._startup_open, previous = False, None
            self._active = previous
            self._arm_backstop()

    def beat(self, point: str) -> None:
        """This rank reached `point` of its current phase (where the ranks meet: written as its heartbeat)."""
        active = self._active
        if active is not None:
            self._enter(_Active(active.phase, active.step, point, active.since, active.timeout_s, active.rule))

    @contextlib.contextmanager
    def held(self, reason: str) -> Iterator[None]:
        """A deliberate wait (a drill's hold, a test's pause), from any thread: no phase is timed while it lasts,
        and the phase clocks leave its length out afterwards. The heartbeat says `held:<reason>`; a hang a peer
        marks meanwhile is still dumped."""
        with self._hold_lock:
            self._holds += 1
            if self._holds == 1:
                self._hold_since = self.clock()
        active = self._active
        self._write_beat("idle" if active is None else active.phase, 0 if active is None else active.step,
                         f"held:{reason}")  # fmt: skip
        self._arm_backstop()
        try:
            yield
        finally:
            with self._hold_lock:
                self._holds -= 1
                if self._holds == 0 and self._hold_since is not None:
                    self._held_s += self.clock() - self._hold_since
                    self._hold_since = None
            active = self._active
            if active is not None:
                self._enter(active)  # back in the phase (its heartbeat again)
            self._arm_backstop()

    def close(self) -> None:
        """Stop watching (the run ended or failed on its own); the heartbeat file keeps the last beat."""
        global _RUNNING  # noqa: PLW0603
        if _RUNNING is self:
            _RUNNING = None
        self._active = None
        self._stop.set()
        self._arm_backstop()
        with self._hold_lock:  # not while a hold in another thread writes its beat
            heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.close()

    # -- judging --

    def check(self, now: float) -> Expiry | None:
        """The current phase if it has run past its timeout at `now`, else None."""
        active = self._active
        if active is None or active.timeout_s is None or self._hold_since is not None:
            return None
        elapsed = now - self._held_total(now) - active.since
        if elapsed <= active.timeout_s:
            return None
        return Expiry(active.phase, active.step, active.point, elapsed, active.timeout_s, active.rule)

    def handle_hang(self, expiry: Expiry | None, detected_by: str = "timeout") -> HangRecord:
        """Dump this rank's stacks (and flight recorder), append its hang record and return it; `expiry` None:
        a peer found the hang (`detected_by`), this rank reports where it is."""
        active = self._active
        now = self._now()
        if expiry is None:
            expiry = (
                Expiry("idle", 0, "", 0.0, 0.0, "")
                if active is None
                else Expiry(active.phase, active.step, active.point, now - active.since, active.timeout_s or 0.0,
                            active.rule)
            )  # fmt: skip
        out = self.output_dir
        if out is not None:
            (out / HANGS_DIR).mkdir(exist_ok=True)
        if out is not None and detected_by == "timeout":
            self._mark_detected(out)
        stacks = self._dump_stacks(out, expiry)
        recorder_path, last_seq = None, None
        if out is not None:
            recorder_path = out / HANGS_DIR / f"{rank_file(self.rank)}-attempt{self.attempt}.fr.json"
            try:
                last_seq = dump_flight_recorder(recorder_path)
            except Exception as err:  # noqa: BLE001 - the stacks and the record matter more than the recorder
                log.warning("flight recorder dump failed: %s: %s", type(err).__name__, err)
            if last_seq is None:
                recorder_path = None
        beats = read_heartbeats(out) if out is not None else {}
        arrival = judge_arrival(beats, self.world_size, self.attempt, self.run_id)
        ours = {r: b for r, b in beats.items() if (b.attempt, b.run_id) == (self.attempt, self.run_id)}
        late_seen = [ours[r].time_unix_s for r in arrival.late_ranks if r in ours]
        record = HangRecord(
            time_unix_s=time.time(), run_id=self.run_id, attempt=self.attempt, rank=self.rank, host=self.host, pid=self.pid,
            phase=expiry.phase, step=expiry.step, point=expiry.point, elapsed_s=round(expiry.elapsed_s, 3),
            timeout_s=round(expiry.timeout_s, 3), timeout_rule=expiry.rule, detected_by=detected_by,
            late_ranks=arrival.late_ranks, waiting_ranks=arrival.waiting_ranks, message=arrival.message,
            stacks=str(stacks), flight_recorder=None if recorder_path is None else str(recorder_path),
            last_collective_seq=last_seq, late_since_unix_s=max(late_seen, default=None),
        )  # fmt: skip
        if out is not None:
            _append_record(out, record)
        log.error("%s", record.describe())
        return record

    # -- internals --

    def _held_total(self, now: float) -> float:
        """How long this watchdog has been held by `now` (on self.clock)."""
        since = self._hold_since
        return self._held_s + (0.0 if since is None else now - since)

    def _now(self) -> float:
        """The phase clock: self.clock less the time held."""
        now = self.clock()
        return now - self._held_total(now)

    def _enter(self, active: _Active) -> None:
        self._active = active
        self._write_beat(active.phase, active.step, active.point)

    def _write_beat(self, phase: str, step: int, point: str) -> None:
        with self._hold_lock:  # a hold may beat from another thread
            self._seq += 1
            if self._heartbeat is None:
                return
            beat = Heartbeat(self.rank, self.attempt, self._seq, phase, step, point, time.time(), self.host,
                             self.pid, self.run_id)  # fmt: skip
            self._heartbeat.write(beat)

    def _arm_backstop(self) -> None:
        """Arm faulthandler's C-level timer for the current phase (BACKSTOP_AFTER_S past its timeout), or disarm
        it between phases; only while the watchdog thread runs (in-process use leaves faulthandler alone)."""
        if self._thread is None:
            return
        active = self._active
        if active is None or active.timeout_s is None or self._stop.is_set() or self._hold_since is not None:
            faulthandler.cancel_dump_traceback_later()
            return
        left = active.timeout_s - (self._now() - active.since)
        faulthandler.dump_traceback_later(max(left, 0.0) + BACKSTOP_AFTER_S, exit=True)

    def _detected_mark(self, out: Path) -> Path:
        """This job attempt's hang mark (named by the run id's digest: an earlier job's mark is not this one's)."""
        job = hashlib.sha256(self.run_id.encode()).hexdigest()[:12]
        return out / HANGS_DIR / f"attempt{self.attempt}-{job}.detected"

    def _mark_detected(self, out: Path) -> None:
        with contextlib.suppress(FileExistsError):  # a peer found it first: its mark stands
            fd = os.open(self._detected_mark(out), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, str(self.rank).encode())
            os.close(fd)

    def _peer_detected(self) -> str | None:
        """"rank N" when a peer marked a hang in this attempt, else None."""
        if self.output_dir is None:
            return None
        mark = self._detected_mark(self.output_dir)
        try:
            return f"rank {mark.read_text().strip() or '?'}"
        except FileNotFoundError:
            return None

    def _dump_stacks(self, out: Path | None, expiry: Expiry) -> str:
        """Every thread's Python stack into this rank's dump file (stderr without a local output folder)."""
        header = (
            f"# hang: rank {self.rank} on {self.host} pid {self.pid}, attempt {self.attempt}, phase {expiry.phase} "
            f"at step {expiry.step} ({expiry.point}), {expiry.elapsed_s:.1f}s > {expiry.timeout_s:.1f}s\n"
        )
        if out is None:
            sys.stderr.write(header)
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            return "stderr"
        path = out / HANGS_DIR / stacks_name(self.rank, self.attempt)
        with open(path, "w") as handle:
            handle.write(header)
            handle.flush()
            faulthandler.dump_traceback(handle, all_threads=True)
        return str(path)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            expiry = self.check(self.clock())
            peer = None if expiry is not None else self._peer_detected()
            if expiry is None and peer is None:
                continue
            if self._stop.is_set():
                return
            try:
                self.handle_hang(expiry, "timeout" if expiry is not None else peer)
                self._await_peers_stacks()
            finally:
                logging.shutdown()
                os._exit(HANG_EXIT_CODE)

    def _await_peers_stacks(self) -> None:
        """Wait (at most STACKS_GRACE_S) until every rank of this attempt dumped its stacks."""
        if self.output_dir is None:
            return
        deadline = time.monotonic() + STACKS_GRACE_S
        while time.monotonic() < deadline and len(stack_dumps(self.output_dir, self.attempt)) < self.world_size:
            time.sleep(POLL_S / 2)


@contextlib.contextmanager
def deliberate_hold(reason: str) -> Iterator[None]:
    """Hold this process's running watchdog (`Watchdog.held`) while a drill point waits on purpose (StepHold,
    SavePause): the wait is no hang, whichever phase it falls in; nothing happens where no watchdog runs."""
    dog = _RUNNING
    if dog is None:
        yield
        return
    with dog.held(reason):
        yield
