"""The hang watchdog (training/watchdog.py): phase timeouts, the auto step timeout, naming the late rank, the dump.

Phase clocks are judged with `Watchdog.check(now)` on a hand-driven clock; the thread's real expiry (stack dump,
record, exit code, a peer dumping on the first rank's mark) runs in two real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tasks.diagnose import diagnose
from tests.conftest import REPO
from training.config import WatchdogConfig
from training.watchdog import (
    HANG_EXIT_CODE,
    Heartbeat,
    StepTimeout,
    Watchdog,
    hang_records,
    judge_arrival,
    read_heartbeats,
    stack_dumps,
    write_heartbeat,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _dog(clock: Clock, **fields: float | None) -> Watchdog:
    return Watchdog(WatchdogConfig(enabled=False, **fields), clock=clock)


def test_startup_runs_until_the_first_step_ends_against_its_own_timeout() -> None:
    clock = Clock()
    dog = _dog(clock, startup_timeout_s=10.0, step_timeout_s=2.0)
    dog.start()
    clock.now = 6.0
    with dog.phase("step", 1):  # the first step is part of start-up: its clock started at the rendezvous
        assert dog.check(9.9) is None
        expired = dog.check(10.5)
        assert expired is not None and (expired.phase, expired.step, expired.point) == ("startup", 1, "first_step")
        clock.now = 9.0
    assert dog.check(1000.0) is None  # between phases nothing is timed
    with dog.phase("step", 2):
        expired = dog.check(11.5)
        assert expired is not None and (expired.phase, expired.timeout_s) == ("step", 2.0)


def test_save_and_eval_have_their_own_timeouts_and_none_is_not_timed() -> None:
    clock = Clock()
    dog = _dog(clock, startup_timeout_s=None, save_timeout_s=3.0, eval_timeout_s=None)
    dog.start()
    assert dog.check(1e6) is None  # start-up not timed
    clock.now = 100.0
    with dog.phase("save", 20):
        assert dog.check(102.9) is None
        expired = dog.check(103.5)
        assert expired is not None and (expired.phase, expired.step, expired.timeout_s) == ("save", 20, 3.0)
    with dog.phase("eval", 20):
        assert dog.check(1e6) is None


def test_the_auto_step_timeout_is_the_floor_or_a_multiple_of_the_slowest_recent_step() -> None:
    timeout = StepTimeout(WatchdogConfig(step_timeout_floor_s=1.0, step_timeout_factor=10.0,
                                         step_timeout_window_steps=5))  # fmt: skip
    assert timeout.seconds() == 1.0  # nothing measured yet: the floor
    for _ in range(5):
        timeout.observe(0.02)
    assert timeout.seconds() == 1.0
    timeout.observe(0.5)
    assert timeout.seconds() == 5.0 and "the slowest of the last 5 steps" in timeout.rule()
    for _ in range(5):  # the slow step left the window
        timeout.observe(0.02)
    assert timeout.seconds() == 1.0
    fixed = StepTimeout(WatchdogConfig(step_timeout_s=7.0))
    fixed.observe(100.0)
    assert fixed.seconds() == 7.0 and fixed.rule() == "watchdog.step_timeout_s=7"


def _noisy_slow_machine() -> list[float]:
    """Step wall times of a busy, slowing machine: 8 s steps with +-50% jitter, every 7th step descheduled for 3x,
    then the machine slows down 4x over 40 steps and stays there."""
    times = []
    for k in range(200):
        base = 8.0 * (1 + 3 * min(1.0, max(0, k - 60) / 40))
        jitter = 0.5 + ((k * 37) % 11) / 10  # deterministic 0.5 .. 1.5
        times.append(base * jitter * (3.0 if k % 7 == 3 else 1.0))
    return times


def test_a_noisy_slow_machine_never_false_alarms_and_a_real_hang_still_does() -> None:
    clock = Clock()
    dog = _dog(clock, startup_timeout_s=None)  # default auto rule: max(60 s, 10 x the slowest of the last 50)
    dog.start()
    times = _noisy_slow_machine()
    assert max(times) > 60.0  # the floor alone would have called these steps hangs
    for step, seconds in enumerate(times, 1):
        with dog.phase("step", step):
            assert dog.check(clock.now + seconds) is None, f"false alarm at step {step} ({seconds:.1f}s)"
            clock.now += seconds
    with dog.phase("step", len(times) + 1):  # a step that never ends
        timeout = dog.steps.seconds()
        assert dog.check(clock.now + timeout - 1) is None
        expired = dog.check(clock.now + timeout + 1)
        assert expired is not None and expired.phase == "step" and expired.timeout_s == timeout


def test_the_rank_that_did_not_arrive_is_named_from_the_heartbeats(tmp_path: Path) -> None:
    dogs = [Watchdog(WatchdogConfig(), rank, 4, tmp_path) for rank in range(4)]  # never started: no thread
    for step in range(1, 8):
        for dog in dogs:
            with dog.phase("step", step):
                dog.beat("loss_sync")
    for dog in dogs:
        if dog.rank != 1:  # rank 1 never starts step 8; the others reach its collective and wait there
            with dog.phase("step", 8):
                dog.beat("loss_sync")
    arrival = judge_arrival(read_heartbeats(tmp_path), 4, attempt=0)
    assert arrival.late_ranks == [1] and arrival.waiting_ranks == [0, 2, 3]
    assert arrival.message == (
        "rank 1 did not arrive: last seen in phase step at step 7 (loss_sync); "
        "ranks 0, 2, 3 wait in phase step at step 8 (loss_sync)"
    )
    # A heartbeat of an earlier attempt does not count; a rank without one in this attempt never arrived.
    write_heartbeat(tmp_path, Heartbeat(rank=2, attempt=1, seq=3, phase="startup", step=0, point="ranks",
                                        time_unix_s=0.0))  # fmt: skip
    arrival = judge_arrival(read_heartbeats(tmp_path), 4, attempt=1)
    assert arrival.late_ranks == [0, 1, 3] and arrival.waiting_ranks == [2]
    assert arrival.message.startswith("ranks 0, 1, 3 did not arrive: no heartbeat in this attempt")
    everyone = judge_arrival({r: Heartbeat(r, 0, 5, "save", 10, "start", 0.0) for r in range(2)}, 2, 0)
    assert everyone.late_ranks == [] and "no rank is behind" in everyone.message


def test_a_hang_leaves_stacks_and_a_record_that_names_the_late_rank(tmp_path: Path) -> None:
    clock = Clock()
    dogs = [Watchdog(WatchdogConfig(step_timeout_s=2.0), rank, 2, tmp_path, clock=clock) for rank in range(2)]
    for dog in dogs:
        with dog.phase("step", 1):
            dog.beat("loss_sync")
    with dogs[0].phase("step", 2):
        dogs[0].beat("loss_sync")
        expired = dogs[0].check(clock.now + 3.0)
        record = dogs[0].handle_hang(expired)
    assert (record.phase, record.step, record.point, record.late_ranks) == ("step", 2, "loss_sync", [1])
    assert hang_records(tmp_path) == [record]
    dump = stack_dumps(tmp_path, 0)[0].read_text()
    assert dump.startswith("# hang: rank 0") and "test_a_hang_leaves_stacks_and_a_record" in dump
    finding = diagnose(output_dir=tmp_path).findings[0]
    assert finding.cause == "hang in phase step (rank(s) 1 did not arrive)"
    assert record.message in finding.evidence and f"stacks of rank 0: {record.stacks}" in finding.evidence


HANGING_RANK = """
import sys, time
from pathlib import Path
from training.config import WatchdogConfig
from training.watchdog import Watchdog

rank, out = int(sys.argv[1]), Path(sys.argv[2])
dog = Watchdog(WatchdogConfig(startup_timeout_s=None, step_timeout_s=0.5), rank, 2, out)
dog.start()
with dog.phase("step", 1):
    dog.beat("loss_sync")
if rank == 0:
    with dog.phase("step", 2):  # rank 0 hangs in step 2, before its collective
        time.sleep(120)
time.sleep(120)  # rank 1 is idle between phases: only rank 0's mark makes it dump
"""


def test_the_watchdog_exits_with_the_hang_code_and_its_peer_dumps_its_stacks_too(tmp_path: Path) -> None:
    script = tmp_path / "hanging_rank.py"
    script.write_text(textwrap.dedent(HANGING_RANK))
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "out")], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for rank in range(2)
    ]
    try:
        codes = [proc.wait(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], [p.stdout.read() for p in procs if p.stdout]
    records = {r.rank: r for r in hang_records(tmp_path / "out")}
    assert records[0].detected_by == "timeout" and (records[0].phase, records[0].step) == ("step", 2)
    assert records[0].late_ranks == [1]  # rank 1 never entered step 2
    assert records[1].detected_by == "rank 0"
    stacks = stack_dumps(tmp_path / "out", 0)
    assert set(stacks) == {0, 1}
    assert all("hanging_rank.py" in path.read_text() for path in stacks.values())


GIL_HOLDING_RANK = """
import ctypes, sys
from pathlib import Path
from training import watchdog
from training.config import WatchdogConfig

watchdog.BACKSTOP_AFTER_S = 0.5
dog = watchdog.Watchdog(WatchdogConfig(startup_timeout_s=None, step_timeout_s=0.3), 0, 1, Path(sys.argv[1]))
dog.start()
with dog.phase("step", 1):
    pass
with dog.phase("step", 2):
    ctypes.PyDLL(None).sleep(30)  # libc sleep with the GIL held: the watchdog thread cannot run
"""


def test_a_hang_that_holds_the_gil_is_still_dumped_by_the_c_level_backstop(tmp_path: Path) -> None:
    script = tmp_path / "gil_holding_rank.py"
    script.write_text(textwrap.dedent(GIL_HOLDING_RANK))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Timeout (0:00:00" in proc.stderr and "gil_holding_rank.py" in proc.stderr  # every thread's stack
    assert hang_records(tmp_path / "out") == []  # the Python thread never ran: only the backstop's dump


def test_an_earlier_jobs_heartbeats_and_hang_mark_in_the_same_folder_are_not_this_jobs(tmp_path: Path) -> None:
    clock = Clock()
    old = Watchdog(WatchdogConfig(step_timeout_s=1.0), 0, 2, tmp_path, clock=clock, run_id="job-a")
    with old.phase("step", 40):  # the earlier job got far, then hung (attempt 0)
        old.handle_hang(old.check(clock.now + 2.0))
    new = [Watchdog(WatchdogConfig(), rank, 2, tmp_path, clock=clock, run_id="job-b") for rank in range(2)]
    with new[1].phase("step", 1):
        pass
    assert new[0]._peer_detected() is None  # job-a's mark does not stop job-b's ranks
    arrival = judge_arrival(read_heartbeats(tmp_path), 2, attempt=0, run_id="job-b")
    assert arrival.late_ranks == [0] and arrival.waiting_ranks == [1]  # job-a's far heartbeat of rank 0 ignored
    with new[0].phase("step", 1):
        new[0].handle_hang(None, "timeout")
    assert new[1]._peer_detected() == "rank 0"
