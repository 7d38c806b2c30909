"""Graceful preemption under torchrun (2 ranks, gloo, the local launcher): a signal to the job's agents mid-run
(SIGTERM as Slurm and Kubernetes send it; SIGUSR1 as Slurm's --signal warning) ends the job preempted, with a
checkpoint of the step the ranks were in; the resubmitted job resumes with the next step and its losses are
bit-identical to an uninterrupted run at the same seed."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.launch.base import JobState
from tasks.launch.local import LocalJob, run_local, start_local
from tasks.spec import DeploymentSpec, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.faults.job import injected
from training.preemption import PREEMPTED_EXIT_CODE, read_records
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

STEPS = 10
# Only the end-of-run save: the one a resumed run finds is the preemption's.
OVERRIDES = {"run": {"steps": STEPS}, "checkpoint": {"save_every_steps": 1000}}


def _spec(root: Path, dataset: str, name: str) -> DeploymentSpec:
    paths = {
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / name / "checkpoints")},
        "run": {"output_url": str(root / name / "output")},
    }
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, paths), OVERRIDES), f"tiny:{name}")


def _losses(output_dir: Path) -> dict[int, tuple[float, float, float]]:
    """Per step: the global loss and each rank's own loss (the later attempt of a step that ran twice)."""
    out = RunOutput(output_dir)
    rank0, rank1 = out.metrics(0), out.metrics(1)
    return {step: (r.loss, r.rank_loss, rank1[step].rank_loss) for step, r in rank0.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> dict[int, tuple[float, float, float]]:
    """The uninterrupted run both preemption tests compare with."""
    spec = _spec(tmp_path_factory.mktemp("preemption"), tiny_dataset, "reference")
    job = run_local(spec.cluster, spec.training_config(), name="reference")
    return _losses(job.output_dir)


def _wait_for_step(job: LocalJob, step: int) -> None:
    deadline = time.monotonic() + 180
    while RunOutput(job.output_dir).last_step() < step if (job.output_dir / "metrics").exists() else True:
        assert not job.status().state.terminal, job.log_tail()
        assert time.monotonic() < deadline, job.log_tail()
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signalled_job_checkpoints_ends_preempted_and_resumes_losing_no_step(
    sig: signal.Signals, reference: dict[int, Any], tmp_path: Path, tiny_dataset: str
) -> None:
    spec = _spec(tmp_path, tiny_dataset, "preempted")
    train = spec.training_config()
    # A slow rank (sleeps only: the numbers stay those of the reference) leaves time to signal mid-run.
    slow = injected(slow_rank=1, slow_step_s=0.3)
    job = start_local(spec.cluster, train, name="preempted", environment=slow)
    _wait_for_step(job, 2)
    job.launcher.signal(job.handle, sig)
    if sig is signal.SIGUSR1:  # Slurm's warning, then its SIGTERM while the workers save: the save still wins
        time.sleep(0.2)
        job.launcher.signal(job.handle, signal.SIGTERM)
    status = job.wait(timeout_s=180)

    assert status.state is JobState.PREEMPTED, (status.describe(), job.log_tail())
    assert status.exit_code == PREEMPTED_EXIT_CODE
    exits = sorted(p.read_text().strip() for p in job.output_dir.glob("exit-*.txt"))
    assert exits == [str(PREEMPTED_EXIT_CODE)]  # the agent itself says "requeue me"
    [record] = read_records(str(job.output_dir))
    step = record.step
    assert record.signal == sig.name and 2 <= step < STEPS and record.signal_to_exit_s >= 0
    assert f"preempted at step {step} by {sig.name}" in status.reason
    assert RunOutput(job.output_dir).last_step() == step  # stopped at the boundary after the signal
    assert RunOutput(job.output_dir).result() is None  # not a finished run
    commit = Path(record.checkpoint) / "COMMIT.json"
    assert commit.is_file() and Path(record.checkpoint).name == f"step-{step:08d}"

    again = run_local(spec.cluster, train, name="resubmitted")
    result = RunOutput(again.output_dir).result()
    assert result is not None and result.resumed_from_step == step and result.steps == STEPS
    first_of_second_run = min(r.step for r in RunOutput(again.output_dir).metric_records(0)[step:])
    assert first_of_second_run == step + 1  # no step lost, none repeated
    assert _losses(again.output_dir) == reference  # bit-identical, both ranks, every step
