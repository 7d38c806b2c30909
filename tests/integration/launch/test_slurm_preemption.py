"""The priority pool on the real Slurm test cluster: a job in the `high` partition preempts a training job in
`low`; the low job checkpoints on Slurm's SIGTERM, is requeued, waits, resumes by itself once the high job is
done, and finishes from the checkpoint's step with no step lost, its losses those of an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.launch.base import JobState
from tasks.launch.local import start_local
from tasks.launch.slurm import SlurmLauncher
from tasks.spec import DeploymentSpec
from tests.faults.job import injected
from training.preemption import read_records
from training.run_output import RunOutput

pytestmark = pytest.mark.integration

STEPS = 8
# Only the end-of-run save: the checkpoint the requeued job finds is the one written on the signal.
OVERRIDES = {"run": {"steps": STEPS}, "checkpoint": {"save_every_steps": 1000}}


def _losses(output_dir: str) -> dict[int, tuple[float, float]]:
    out = RunOutput(output_dir)
    rank1 = out.metrics(1)
    return {step: (r.loss, rank1[step].rank_loss) for step, r in out.metrics(0).items()}


def _status_lines(ref: str, env: dict[str, str]) -> list[str]:
    """`tdeploy status REF`'s lines, without the time column."""
    result = CliRunner().invoke(app, ["status", ref], env=env, terminal_width=200)
    assert result.exit_code == 0, result.output
    return [re.sub(r"^ +(\d\d:\d\d:\d\d)? +", "", line) for line in result.output.splitlines()]


def test_a_low_priority_job_is_preempted_requeued_and_resumes_from_its_checkpoint_with_no_step_lost(
    slurm_cluster, make_spec, monkeypatch
) -> None:
    for key, value in slurm_cluster.items():
        monkeypatch.setenv(key, value)
    env = dict(os.environ)
    spec = make_spec({**OVERRIDES, "cluster": {"scheduler": "slurm", "slurm": {"partition": "low"}}}, name="low")
    launcher = SlurmLauncher(slurm_cluster)
    # the uninterrupted reference runs meanwhile, beside Slurm (the low job mostly waits)
    reference = make_spec(OVERRIDES, name="reference")
    reference_job = start_local(reference.cluster, reference.training_config(), name="reference")
    try:
        _preempt_and_resume(launcher, spec, env)
        finished = reference_job.wait(timeout_s=300)
    finally:
        if not reference_job.status().state.terminal:
            reference_job.cancel()
    assert finished.state is JobState.SUCCEEDED, reference_job.log_tail()
    assert _losses(spec.run.output_url) == _losses(reference.run.output_url), "bit-identical to an uninterrupted run"


def _preempt_and_resume(launcher: SlurmLauncher, spec: DeploymentSpec, env: dict[str, str]) -> None:
    """Submit the low job, preempt it with a high one mid-run, watch it come back and finish; check its history."""
    # one slow rank (0.5 s a step): the high job arrives mid-run
    faults = injected(slow_rank=0, slow_step_s=0.5)
    low = launcher.submit(spec.cluster, spec.training_config(), "tdeploy-low", environment=faults)
    out = RunOutput(spec.run.output_url)
    deadline = time.monotonic() + 240
    while not (out.dir / "metrics").exists() or out.last_step() < 2:
        assert not launcher.status(low).state.terminal, launcher.logs(low)[0][-30:]
        assert time.monotonic() < deadline, launcher.logs(low)[0][-30:]
        time.sleep(0.2)
    high = subprocess.run(
        ["sbatch", "--parsable", "--partition=high", "--exclusive", f"--output={out.dir.parent}/high-%j.out",
         "--wrap", "sleep 6"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip

    seen: list[tuple[JobState, str]] = []
    pending_history: list[str] = []
    left_node_unix_s = None
    deadline = time.monotonic() + 240
    while not (status := launcher.status(low)).state.terminal:
        if not seen or seen[-1] != (status.state, status.reason):
            seen.append((status.state, status.reason))
        if status.state is JobState.PENDING and left_node_unix_s is None:
            left_node_unix_s = time.time()
            pending_history = _status_lines(low.ref, env)
        assert time.monotonic() < deadline, (seen, launcher.logs(low)[0][-40:])
        time.sleep(0.2)
    assert status.state is JobState.SUCCEEDED, (seen, "\n".join(launcher.logs(low)[0][-60:]))
    states = [state for state, _ in seen]
    assert states[0] is JobState.RUNNING and JobState.PENDING in states, seen
    assert states[states.index(JobState.PENDING) :].count(JobState.RUNNING) >= 1, "it ran again by itself"
    assert any(reason in ("BeginTime", "Priority", "Resources") for state, reason in seen if state is JobState.PENDING)
    assert launcher.restarts(low) == 1

    (record,) = read_records(spec.run.output_url)
    assert record.signal == "SIGTERM", record  # Slurm's preemption signal (the partition's GraceTime follows)
    steps = [r.step for r in out.metric_records(0)]
    assert steps == list(range(1, STEPS + 1)), "every step once: none lost, none repeated"
    assert 2 <= record.step < STEPS
    preempted_line = (
        f"preempted at step {record.step} (SIGTERM, {record.signal_to_exit_s:.1f} s from signal to exit, "
        "checkpoint saved)"
    )
    assert pending_history[1:3] == ["running from step 0", preempted_line], pending_history
    # Right after the requeue slurmctld may not have set a reason yet ("None", printed as none): `seen` holds it.
    assert re.fullmatch(rf"pending( \(\w+\))? to resume from step {record.step}", pending_history[3]), pending_history
    assert pending_history[4] == "scheduler restarts (requeues): 1", pending_history
    final = _status_lines(low.ref, env)
    assert final[0].startswith(f"{low.ref}: succeeded")
    assert final[1:-1] == [
        "running from step 0",
        preempted_line,
        f"running again from step {record.step}",
        f"finished at step {STEPS}",
        "scheduler restarts (requeues): 1",
    ], final
    # the job's goodput last (tasks/launch/goodput.py): the preemption's requeue and restart are badput
    assert re.fullmatch(r"goodput \d+\.\d% of [\d.]+s; badput: .+", final[-1]), final

    assert any("tdeploy: checkpointed on the signal; requeueing job" in line for line in launcher.logs(low)[0])
    signalled = record.time - record.signal_to_exit_s
    print(  # the figures of the closing note (no thresholds here)
        f"preemption (high job {high}): SIGTERM to trainer exit {record.signal_to_exit_s:.2f} s, SIGTERM to the job "
        f"off the node (pending, polled every 0.2 s) {left_node_unix_s - signalled:.1f} s; steps lost 0"
    )
