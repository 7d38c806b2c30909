"""Background checkpoint saves in real processes: one SIGKILLed in the middle of its save leaves no checkpoint
visible (the previous one is what loads), and the trainer commits its last background save, and the one a
preemption finds in flight, before the process exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tasks.launch.environment import JobEnvironment
from tests.conftest import read_jsonl
from tests.processes import run_group, start_group, stop_group
from training.checkpoint import COMMIT, KEY_ENV, CheckpointManager, step_dir_name
from training.config import CheckpointConfig
from training.drill_points import SAVE_PHASES, paused_ranks
from training.preemption import PREEMPTED_EXIT_CODE
from training.storage import StorageConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# Saves step 1, then starts the background save of step 2 (which the job's pause_in_save drill point stops for good at
# one phase point), says that the caller got control back, and trains on until it is killed.
SAVER = """
import sys, time, warnings
import torch
from training.checkpoint import CheckpointManager
from training.config import CheckpointConfig
from training.storage import StorageConfig

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
root, returned = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
manager = CheckpointManager(CheckpointConfig(url=root), StorageConfig())
manager.save(1, model, optimizer, {"step": 1})
manager.save_async(2, model, optimizer, {"step": 2})
open(returned, "w").close()
while True:
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    time.sleep(0.01)
"""


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("phase", [p for p in SAVE_PHASES if p != "after_commit"])
def test_a_process_killed_during_a_background_save_leaves_the_previous_checkpoint_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    root, returned, markers = tmp_path / "ckpt", tmp_path / "returned", tmp_path / "markers"
    pause = {"phase": phase, "step": 2, "marker_dir": str(markers)}
    env = {**os.environ, **JobEnvironment().with_drill_points(pause_in_save=pause).variables()}
    proc = start_group(
        [sys.executable, "-c", SAVER, str(root), str(returned)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (returned.exists() and paused_ranks(str(markers))):
            assert proc.poll() is None, f"the saver exited: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
            assert time.monotonic() < deadline, "the background save never reached its pause"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the save is stopped in its thread while the caller trains on
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        stop_group(proc, grace_s=0.5)

    killed = root / step_dir_name(2)
    assert any(killed.glob("*.distcp")) and not (killed / COMMIT).exists()
    manager = CheckpointManager(CheckpointConfig(url=str(root)), StorageConfig())
    skipped: list = []
    found = manager.latest_sound(skipped)
    assert found is not None and found[0] == 1
    assert [(s.step, s.reason) for s in skipped] == [(2, "partial")]
    restored = manager.load_latest(*_model())
    assert restored is not None and restored.step == 1


# Runs the trainer in this plain process with every commit slowed down (a slow upload): without the waits, the
# process would exit (os._exit) before the background save committed. `signal_in_step` > 0: SIGTERM arrives in
# that step, so the preemption stops the run at its end, where the schedule's background save is in flight.
TRAINER = """
import os, signal, sys, time
from training import checkpoint, train

config, signal_in_step = sys.argv[1], int(sys.argv[2])
commit = checkpoint.CheckpointManager._commit

def slow_commit(self, *args, **kwargs):
    time.sleep(1.5)
    return commit(self, *args, **kwargs)

checkpoint.CheckpointManager._commit = slow_commit
train_step = train.Trainer.train_step

def signalling(self):
    if self.step + 1 == signal_in_step:
        os.kill(os.getpid(), signal.SIGTERM)
    return train_step(self)

train.Trainer.train_step = signalling
code = train.main(["--config", config])
sys.stdout.flush(); sys.stderr.flush()
os._exit(code)
"""


@pytest.mark.parametrize(
    ("steps", "signal_in_step", "saved", "code"),
    [(8, 0, [3, 6], 0), (8, 3, [3], PREEMPTED_EXIT_CODE)],
    ids=["run-end", "preempted-during-a-background-save"],
)
def test_the_trainer_commits_its_background_saves_before_the_process_exits(
    make_spec, steps: int, signal_in_step: int, saved: list[int], code: int
) -> None:
    spec = make_spec({"run": {"steps": steps}, "checkpoint": {"save_every_steps": 3, "save_at_end": False}})
    cfg = spec.training_config()
    assert cfg.checkpoint.async_save  # the default
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True)
    cfg.to_json_file(out / "run.json")
    proc = run_group([sys.executable, "-c", TRAINER, str(out / "run.json"), str(signal_in_step)], 300, cwd=ROOT)

    assert proc.returncode == code, proc.stderr[-3000:]
    events = read_jsonl(out / "checkpoints.jsonl")
    assert [e["step"] for e in events] == saved and all("error" not in e for e in events)  # none lost, none twice
    for step in saved:
        assert (Path(cfg.checkpoint.url) / step_dir_name(step) / COMMIT).is_file(), step
    assert json.loads((Path(cfg.checkpoint.url) / step_dir_name(saved[-1]) / COMMIT).read_text())["step"] == saved[-1]


# Starts a background save that never gets to write (its peer is gone, say) and then fails on the training side.
FAILS_DURING_SAVE = """
import sys, threading, warnings
import torch
from training.checkpoint import CheckpointManager
from training.config import CheckpointConfig
from training.storage import StorageConfig

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
CheckpointManager._run = lambda self, job: threading.Event().wait()  # stuck, like a collective with a dead rank
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
manager = CheckpointManager(CheckpointConfig(url=sys.argv[1]), StorageConfig())
manager.save_async(2, model, optimizer, {"step": 2})
raise SystemExit("the training step failed")
"""


def test_a_process_that_fails_with_a_background_save_stuck_exits_at_once_with_nothing_committed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", FAILS_DURING_SAVE, str(root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,  # a save thread the interpreter waits for at exit would hold the process forever
    )
    assert proc.returncode == 1 and "the training step failed" in proc.stderr
    assert not list(root.glob(f"*/{COMMIT}"))
    assert CheckpointManager(CheckpointConfig(url=str(root)), StorageConfig()).committed_steps() == []
