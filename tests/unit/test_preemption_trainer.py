"""The trainer's preemption handling, in one plain process (no torchrun): a signal that arrives during a
checkpoint save or an evaluation leaves both intact and stops the run at the next step boundary; a step whose
checkpoint the schedule writes anyway is not saved twice; the record and the exit status say so."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import read_jsonl
from tests.processes import run_group
from training.preemption import PREEMPTED_EXIT_CODE, WATCH, agreed_signal, read_records
from training.run_output import RunOutput

# Runs the trainer with one hook that signals this very process in the save or the evaluation of step 2.
DRIVER = """
import os, signal, sys
from training import train

where, config = sys.argv[1], sys.argv[2]

def signalling(original, step_wanted):
    def hook(self, *args, **kwargs):
        if self.step == step_wanted:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)
    return hook

if where == "save":
    train.Trainer._save = signalling(train.Trainer._save, 2)
else:
    train.Trainer.evaluate = signalling(train.Trainer.evaluate, 2)
code = train.main(["--config", config])
sys.stdout.flush(); sys.stderr.flush()
os._exit(code)
"""


@pytest.mark.parametrize(
    ("where", "overrides", "stopped_at", "saved"),
    [
        # Saved every step: the preemption's step 3 is saved by the schedule already, and not a second time.
        ("save", {"checkpoint": {"save_every_steps": 1}}, 3, [1, 2, 3]),
        ("eval", {"run": {"eval_every_steps": 2}}, 3, [3]),
    ],
    ids=["signal-during-save", "signal-during-eval"],
)
def test_a_signal_stops_the_run_at_the_next_step_boundary_with_a_checkpoint(
    make_spec, tmp_path: Path, where: str, overrides: dict, stopped_at: int, saved: list[int]
) -> None:
    spec = make_spec({"run": {"steps": 8}, **overrides})
    cfg = spec.training_config()
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True)
    cfg.to_json_file(out / "run.json")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    root = Path(__file__).resolve().parents[2]
    proc = run_group([sys.executable, str(driver), where, str(out / "run.json")], timeout=300, cwd=root)

    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-3000:]
    [record] = read_records(str(out))
    assert (record.step, record.signal) == (stopped_at, "SIGTERM")
    assert record.checkpoint == str(Path(cfg.checkpoint.url) / f"step-{stopped_at:08d}")
    events = read_jsonl(out / "checkpoints.jsonl")
    assert [e["step"] for e in events] == saved and all("error" not in e for e in events)  # none twice, none lost
    for step in saved:
        assert (Path(cfg.checkpoint.url) / f"step-{step:08d}" / "COMMIT.json").is_file()
    output = RunOutput(out)
    assert output.last_step() == stopped_at and output.result() is None
    if where == "eval":
        assert [e["step"] for e in output.evals()] == [2]  # the evaluation the signal came in finished


def test_the_watch_records_the_first_signal_only_and_the_ranks_agree_on_any() -> None:
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        WATCH.request = None
        assert WATCH.install()
        assert WATCH.flags() == [0.0, 0.0]
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGTERM)  # a second signal changes nothing
        assert WATCH.request is not None and WATCH.request.signal == "SIGUSR1"
        assert WATCH.flags() == [0.0, 1.0]
    finally:
        WATCH.request = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert agreed_signal([0.0, 0.0]) is None
    assert agreed_signal([0.0, 0.25]) == "SIGUSR1"  # one rank of four, averaged
    assert agreed_signal([0.5, 0.5]) == "SIGTERM"
