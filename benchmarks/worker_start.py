"""Start-up of a local job's workers: forked from their agent with the payload imported, against a new interpreter
each (training/worker_start.py), side by side in one run.

Each round launches the same tiny 2-rank job (the tests' tiny model, gloo, a few steps) once per mode, the modes
alternating so that the machine's load falls on both alike:
- `exec`: TDEPLOY_WORKER_START=exec, torchrun's own way: every worker a `python -m training.train`;
- `fork`: the default for CPU jobs: the agent imports the payload once and forks its workers.

Printed per mode (medians over the rounds): start-up (from the submission to the end of the first step, read
from the job's own step records: torchrun, the imports, the process group, the model, the first step), the
job's wall time, and the CPU seconds of all its processes (agent, workers; from the kernel's accounting of
the wrapper's reaped children, so the import work that fork saves shows even on a busy machine). Then a
restart: a rank SIGKILLed after step `--kill-after` of a `--max-restarts 1` job, timed from the kill to the
first step trained after it (the restarted workers' start-up plus the resume), per mode.

Usage: python benchmarks/worker_start.py [--rounds 3] [--steps 4] [--kill-after 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.launch.base import JobState  # noqa: E402
from tasks.launch.local import start_local  # noqa: E402
from tasks.prepare.config import PrepareConfig  # noqa: E402
from tasks.prepare.pipeline import prepare_dataset  # noqa: E402
from tasks.spec import DeploymentSpec, parse_spec  # noqa: E402
from tests.conftest import TINY_SPEC, deep_merge  # noqa: E402 - the tests' tiny model
from training.run_output import RunOutput  # noqa: E402
from training.storage import StorageConfig  # noqa: E402
from training.worker_start import WORKER_START_ENV  # noqa: E402

MODES = ("exec", "fork")


def _dataset(root: Path) -> str:
    cfg = PrepareConfig(output_url=str(root / "dataset"), builtin_corpus="python-docs", builtin_max_bytes=300_000,
                        tokenizer={"kind": "bytes"}, workers=1)  # fmt: skip
    return prepare_dataset(cfg, StorageConfig(), validate=False).dataset_url


def _spec(root: Path, dataset: str, name: str, steps: int, restarts: int = 0) -> DeploymentSpec:
    paths = {"data": {"dataset_url": dataset}, "checkpoint": {"url": str(root / name / "ckpt"), "save_every_steps": 2},
             "run": {"output_url": str(root / name / "out"), "steps": steps},
             "deployment_dir": str(root / name / "deployment"), "cluster": {"max_restarts": restarts}}  # fmt: skip
    return parse_spec(deep_merge(TINY_SPEC, paths), f"bench:{name}")


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped descendants: the job's wrapper, once reaped, counts its agent and the
    agent's workers (each reaped by its parent)."""
    deadline = time.monotonic() + 10
    while subprocess._active and time.monotonic() < deadline:  # type: ignore[attr-defined]
        subprocess._cleanup()  # type: ignore[attr-defined] - reap the wrappers of ended jobs, as Popen would later
        time.sleep(0.05)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _first_step_end(out: Path, after_unix_s: float) -> float | None:
    ends = [r.time_unix_s for r in RunOutput(out).metric_records() if r.time_unix_s and r.time_unix_s >= after_unix_s]
    return min(ends) if ends else None


def launch_once(spec: DeploymentSpec, mode: str) -> dict[str, float]:
    """One job to its end in `mode`: start-up s, wall s, CPU s of its processes."""
    os.environ[WORKER_START_ENV] = mode
    cpu0, submitted = _children_cpu_s(), time.time()
    job = start_local(spec.cluster, spec.training_config(), f"bench-{mode}")
    status = job.wait(timeout_s=600)
    wall = time.time() - submitted
    if status.state is not JobState.SUCCEEDED:
        raise SystemExit(f"{mode} job {status.describe()}: {job.log_tail()}")
    first = _first_step_end(job.output_dir, submitted)
    return {"startup": (first or float("nan")) - submitted, "wall": wall, "cpu": _children_cpu_s() - cpu0}


def restart_once(spec: DeploymentSpec, mode: str, kill_after: int) -> float:
    """Seconds from a rank's SIGKILL (after step `kill_after`) to the first step trained after it, in `mode`."""
    os.environ[WORKER_START_ENV] = mode
    job = start_local(spec.cluster, spec.training_config(), f"bench-restart-{mode}")
    out, deadline = job.output_dir, time.monotonic() + 300
    while True:
        done = [r for r in RunOutput(out).metric_records() if r.step >= kill_after]
        if done:
            break
        if time.monotonic() > deadline or job.status().state.terminal:
            raise SystemExit(f"{mode}: step {kill_after} never came: {job.log_tail()}")
        time.sleep(0.02)
    ranks = RunOutput(out).ranks()
    victim: Any = next(r for r in ranks.ranks if r["rank"] == 1)
    killed = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    status = job.wait(timeout_s=600)
    if status.state is not JobState.SUCCEEDED:
        raise SystemExit(f"{mode} restart job {status.describe()}: {job.log_tail()}")
    first = _first_step_end(out, killed)
    return (first or float("nan")) - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kill-after", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="worker-start-") as tmp:
        root = Path(tmp)
        dataset = _dataset(root)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        restarts: dict[str, list[float]] = {mode: [] for mode in MODES}
        for n in range(args.rounds):
            order = MODES if n % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(launch_once(_spec(root, dataset, f"{mode}-{n}", args.steps), mode))
            for mode in order:
                spec = _spec(root, dataset, f"restart-{mode}-{n}", args.kill_after + 3, restarts=1)
                restarts[mode].append(restart_once(spec, mode, args.kill_after))
    load = os.getloadavg()[0]
    print(f"worker start-up, {args.rounds} rounds alternating, 2 ranks, tiny model, {args.steps} steps "
          f"(load {load:.1f}, {os.cpu_count()} cores); medians")  # fmt: skip
    print(f"{'mode':<6} {'start-up s':>11} {'job wall s':>11} {'job CPU s':>10} {'restart s':>10}")
    med = {mode: {key: statistics.median(r[key] for r in runs[mode]) for key in ("startup", "wall", "cpu")}
           for mode in MODES}  # fmt: skip
    restart = {mode: statistics.median(restarts[mode]) for mode in MODES}
    for mode in MODES:
        m = med[mode]
        print(f"{mode:<6} {m['startup']:>11.2f} {m['wall']:>11.2f} {m['cpu']:>10.2f} {restart[mode]:>10.2f}")
    print(f"fork / exec: start-up {med['fork']['startup'] / med['exec']['startup']:.2f}, job wall "
          f"{med['fork']['wall'] / med['exec']['wall']:.2f}, job CPU {med['fork']['cpu'] / med['exec']['cpu']:.2f}, "
          f"restart {restart['fork'] / restart['exec']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
