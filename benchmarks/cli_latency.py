"""Latency of the command line: `--help`, `--version` and every read-only or planning command, against `import torch`.

Each command runs N times as a fresh process (`python -c "from flows.cli import main; main()"` on this checkout,
or on another one with --repo, to measure a change against its parent); the median wall time is printed beside the
median of `python -c "import torch"` measured in the same run. The commands: `validate-spec` of every example spec
(examples/*.yaml), `plan` and `render` of a small and a large one, `schema`, `history` and `baseline` of a copy of
examples/local.yaml in a scratch folder (an empty ledger: what a new deployment reads), `status` and `diagnose` of a
finished local job's folder made up here (job.json, its exit record and a log). Goals: `tdeploy --help` under 1 s;
on an idle 2-core machine each read-only command under 2 s, none importing torch, Prefect or Great Expectations
(tests/unit/test_cli_read_only.py checks the imports).

Usage: python benchmarks/cli_latency.py [-n 7] [--repo PATH] [--only validate-spec,plan]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = 'python -c "import torch"'
READ_ONLY = ("validate-spec", "plan", "render", "schema", "history", "baseline", "status", "diagnose")
GOAL_S = 2.0


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _median_s(cmd: list[str], cwd: Path, runs: int) -> tuple[float, float, int]:
    """Median wall time and median CPU time (user + system) of `runs` fresh runs of `cmd`, and the exit code of the
    last. The CPU time hardly moves with the machine's load; the wall time is what a user waits on an idle one."""
    walls, cpus, code = [], [], 0
    for _ in range(runs):
        start, cpu = time.perf_counter(), _children_cpu_s()
        code = subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=600).returncode
        walls.append(time.perf_counter() - start)
        cpus.append(_children_cpu_s() - cpu)
    return statistics.median(walls), statistics.median(cpus), code


def _finished_job(folder: Path) -> Path:
    """A finished local job's output folder as `tdeploy submit` leaves it (job.json, exit record, log)."""
    folder.mkdir()
    dead_agent = {"pid": 2**22 + 1, "start_time": 1}  # above pid_max's default: never a live process
    handle = {"scheduler": "local", "job_id": "x1", "name": "local", "output_dir": str(folder),
              "log_path": str(folder / "train.log"), "submitted_unix_s": 0.0, "details": {"agents": [dead_agent]},
              "env": {}, "extra_env": {}}  # fmt: skip
    (folder / "job.json").write_text(json.dumps(handle))
    (folder / "exit-0.txt").write_text("0\n")
    (folder / "train.log").write_text("step 1 loss 7.6\n")
    return folder


def _cases(repo: Path, scratch: Path) -> dict[str, tuple[list[str], Path]]:
    """Label -> (command, folder it runs in)."""
    entry = f"import sys; sys.path.insert(0, {str(repo)!r}); from flows.cli import main; main()"
    tdeploy = [sys.executable, "-c", entry]
    shutil.copy(repo / "examples" / "local.yaml", scratch / "local.yaml")
    job = _finished_job(scratch / "job")
    cases: dict[str, tuple[list[str], Path]] = {
        REFERENCE: ([sys.executable, "-c", "import torch"], repo),
        "tdeploy --help": ([*tdeploy, "--help"], repo),
        "tdeploy --version": ([*tdeploy, "--version"], repo),
    }
    for spec in sorted(path.name for path in (repo / "examples").glob("*.yaml")):
        cases[f"tdeploy validate-spec examples/{spec}"] = ([*tdeploy, "validate-spec", f"examples/{spec}"], repo)
    for spec in ("local.yaml", "plan-70b.yaml"):
        out = scratch / f"plan-{spec}"
        cases[f"tdeploy plan examples/{spec}"] = ([*tdeploy, "plan", f"examples/{spec}", "--out", str(out)], repo)
    for spec in ("local.yaml", "slurm.yaml"):
        out = scratch / f"rendered-{spec}"
        cases[f"tdeploy render examples/{spec}"] = ([*tdeploy, "render", f"examples/{spec}", "--out", str(out)], repo)
    cases["tdeploy schema"] = ([*tdeploy, "schema", "--out", str(scratch / "spec.schema.json")], repo)
    cases["tdeploy history local.yaml (empty ledger)"] = ([*tdeploy, "history", "local.yaml"], scratch)
    cases["tdeploy baseline local.yaml (empty ledger)"] = ([*tdeploy, "baseline", "local.yaml"], scratch)
    cases["tdeploy status <finished job>"] = ([*tdeploy, "status", str(job)], scratch)
    diagnose = [*tdeploy, "diagnose", str(job), "--spec", "local.yaml"]
    cases["tdeploy diagnose <finished job> --spec local.yaml"] = (diagnose, scratch)
    return cases


def main() -> None:
    """Time each command and print a table with its ratio to `import torch`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=7, help="runs per command (median)")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose CLI to time (default: this one)")
    parser.add_argument("--only", default="", help="comma-separated commands to time (default: all)")
    args = parser.parse_args()
    repo = args.repo.resolve()
    only = [name for name in args.only.split(",") if name]
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        cases = _cases(repo, Path(tmp))
        if only:
            cases = {k: v for k, v in cases.items() if k == REFERENCE or any(f"tdeploy {n}" in k for n in only)}
        results = {label: _median_s(cmd, cwd, args.n) for label, (cmd, cwd) in cases.items()}
    torch_s, torch_cpu_s, _ = results[REFERENCE]
    print(f"median of {args.n} runs each, CLI of {repo}")
    print(f"{'command':56s} {'wall s':>7s} {'/ torch':>8s} {'CPU s':>7s} {'/ torch':>8s}  exit")
    for label, (seconds, cpu_s, code) in results.items():
        print(f"{label:56s} {seconds:7.3f} {seconds / torch_s:8.2f} {cpu_s:7.3f} {cpu_s / torch_cpu_s:8.2f}  {code}")
    read_only = {
        label: seconds
        for label, (seconds, _, _) in results.items()
        if any(f"{label} ".startswith(f"tdeploy {command} ") for command in READ_ONLY)
    }
    if read_only:
        worst = max(read_only, key=read_only.__getitem__)
        over = [k for k, s in read_only.items() if s >= GOAL_S]
        print(f"read-only commands: slowest {worst} at {read_only[worst]:.3f} s wall; {len(over)} of "
              f"{len(read_only)} at or over the {GOAL_S:g} s goal (wall, on this machine's load)")  # fmt: skip
    if "tdeploy --help" in results:
        help_s = results["tdeploy --help"][0]
        print(f"tdeploy --help: {help_s:.3f} s ({'under' if help_s < 1 else 'OVER'} the 1 s goal)")


if __name__ == "__main__":
    main()
