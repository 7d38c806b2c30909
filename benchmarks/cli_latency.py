"""Latency of the command line: `tdeploy --help`, `--version` and `validate-spec` against an eager import.

Each command runs N times as a fresh process (the installed `tdeploy` script, from the repository root);
the median wall time is printed beside the median of `python -c "import torch, prefect"` measured in the
same run: the cost every command paid while the CLI (flows/cli/) imported the pipeline at module level.
Goal: `tdeploy --help` under 1 s.

Usage: python benchmarks/cli_latency.py [-n 7] [--spec examples/local.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tdeploy() -> list[str]:
    script = Path(sys.executable).parent / "tdeploy"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from flows.cli import main; main()"]


def _median_s(cmd: list[str], runs: int) -> tuple[float, int]:
    """Median wall time of `runs` fresh runs of `cmd`, and the exit code of the last."""
    times, code = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        code = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=300).returncode
        times.append(time.perf_counter() - start)
    return statistics.median(times), code


def main() -> None:
    """Time each command and print a table with its ratio to the eager import."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=7, help="runs per command (median)")
    parser.add_argument("--spec", default="examples/local.yaml", help="spec for validate-spec")
    args = parser.parse_args()
    tdeploy = _tdeploy()
    cases = {
        'python -c "import torch, prefect"': [sys.executable, "-c", "import torch, prefect"],
        "tdeploy --help": [*tdeploy, "--help"],
        "tdeploy --version": [*tdeploy, "--version"],
        f"tdeploy validate-spec {args.spec}": [*tdeploy, "validate-spec", args.spec],
    }
    results = {label: _median_s(cmd, args.n) for label, cmd in cases.items()}
    eager_s = results['python -c "import torch, prefect"'][0]
    print(f"median of {args.n} runs each, from {REPO}")
    print(f"{'command':52s} {'median s':>9s} {'/ eager import':>15s}  exit")
    for label, (seconds, code) in results.items():
        print(f"{label:52s} {seconds:9.3f} {seconds / eager_s:15.2f}  {code}")
    help_s = results["tdeploy --help"][0]
    print(f"tdeploy --help: {help_s:.3f} s ({'under' if help_s < 1 else 'OVER'} the 1 s goal)")


if __name__ == "__main__":
    main()
