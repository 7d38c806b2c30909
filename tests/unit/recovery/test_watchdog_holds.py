"""A deliberate hold is no hang: the drill points that stop ranks on purpose (StepHold after a step, SavePause inside
a save) hold the watchdog, so that a timed phase around them never expires while they wait (training/watchdog.py
`Watchdog.held`, `deliberate_hold`).

Phase clocks are judged with `Watchdog.check(now)` on a hand-driven clock; the real drill points run in a child
process with a started watchdog whose clock jumps an hour ahead once the rank waits, so that a hold that counted
would expire at once (the child would exit with HANG_EXIT_CODE).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from training.config import WatchdogConfig
from training.watchdog import HANG_EXIT_CODE, Watchdog, hang_records, read_heartbeats


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_hold_inside_a_timed_phase_stops_its_clock_and_the_phase_goes_on_afterwards() -> None:
    clock = Clock()
    dog = Watchdog(WatchdogConfig(enabled=False, save_timeout_s=10.0), clock=clock)
    with dog.phase("save", 3):
        clock.now = 5.0
        with dog.held("drill pause"):
            clock.now = 3605.0
            assert dog.check(clock.now) is None  # an hour held: not timed
        assert dog.check(9.0 + 3600.0) is None  # 9 s of the save ran, the hour held is not counted
        expired = dog.check(10.5 + 3600.0)
        assert expired is not None and (expired.phase, expired.step, expired.point) == ("save", 3, "start")
        assert expired.elapsed_s == pytest.approx(10.5)


def test_a_hold_between_phases_leaves_nothing_timed_and_a_held_step_does_not_widen_the_auto_timeout() -> None:
    clock = Clock()
    dog = Watchdog(WatchdogConfig(enabled=False, step_timeout_floor_s=1.0, step_timeout_factor=10.0), clock=clock)
    dog.start()
    with dog.phase("step", 1):
        clock.now = 0.5
    with dog.held("drill hold after step 1"):
        clock.now = 600.0
    assert dog.check(1e6) is None
    with dog.phase("step", 2):
        clock.now = 600.2
        with dog.held("test pause"):
            clock.now = 1200.2
        clock.now = 1200.3
    assert dog.steps.seconds() == pytest.approx(5.0)  # 10 x the slowest step (0.5 s), not of the held one


def test_a_hold_from_another_thread_spans_the_phases_the_trainer_goes_through_meanwhile() -> None:
    clock = Clock()  # a SavePause in a background save holds while the trainer's own thread trains on
    dog = Watchdog(WatchdogConfig(enabled=False, step_timeout_s=2.0), clock=clock)
    dog.start()
    with dog.phase("step", 1):
        pass
    pause = dog.held("drill pause in a background save")
    pause.__enter__()
    with dog.phase("step", 2):
        clock.now = 100.0
        assert dog.check(clock.now) is None
    with dog.phase("step", 3):
        clock.now = 200.0
        pause.__exit__(None, None, None)
        assert dog.check(201.0) is None
        expired = dog.check(202.5)  # step 3's clock counts from the end of the hold
        assert expired is not None and expired.step == 3 and expired.elapsed_s == pytest.approx(2.5)


DRILL_RANK = """
import json, os, sys, threading, time
from pathlib import Path

out, markers, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "hold":  # every rank waits after step 2 (rank_kill, node_loss); it goes on by itself after 6 s
    points = {"hold_after_step": {"step": 2, "marker_dir": markers, "timeout_s": 6.0}}
else:  # every rank stops for good inside the save of step 2 (kill_during_save)
    points = {"pause_in_save": {"phase": "after_dcp", "step": 2, "marker_dir": markers}}
os.environ["TDEPLOY_DRILL_POINTS"] = json.dumps(points)

from training import drill_points, watchdog
from training.config import WatchdogConfig

skew = 0.0
dog = watchdog.Watchdog(WatchdogConfig(startup_timeout_s=None, step_timeout_s=5.0, save_timeout_s=5.0), 0, 1, out,
                        clock=lambda: time.monotonic() + skew)


def an_hour_passes_once_the_rank_waits():
    global skew
    deadline = time.monotonic() + 3.0  # a hold that never tells the watchdog still gets its hour
    while time.monotonic() < deadline:
        beat = watchdog.read_heartbeats(out).get(0)
        if beat is not None and beat.point.startswith("held:"):
            break
        time.sleep(0.01)
    skew = 3600.0


dog.start()
with dog.phase("step", 1):
    pass
threading.Thread(target=an_hour_passes_once_the_rank_waits, daemon=True).start()
if mode == "hold":
    with dog.phase("step", 2):  # held inside the step: the hold counts for nothing wherever it falls
        drill_points.hold(2)
    print("went on after the hold", flush=True)
else:
    with dog.phase("save", 2):  # the rank stops inside the save (its own thread here: the test goes on)
        threading.Thread(target=drill_points.at_save_phase, args=("after_dcp", 2), daemon=True).start()
        time.sleep(5.0)  # the watchdog polls 50 times meanwhile
    print("still paused", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["hold", "pause"])
def test_a_drill_points_deliberate_wait_in_a_timed_phase_is_no_hang(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "drill_rank.py"
    script.write_text(textwrap.dedent(DRILL_RANK))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(tmp_path / "markers"), mode],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode != HANG_EXIT_CODE and hang_records(tmp_path / "out") == [], proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    if mode == "pause":  # the paused rank's heartbeat says why it waits
        assert read_heartbeats(tmp_path / "out")[0].point == "held:drill pause at save phase after_dcp of step 2"
