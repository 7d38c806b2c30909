"""benchmarks/gpu_mfu.py, prepared for a GPU machine, runs here: without a GPU it says so and exits 1; --smoke
runs its step on a tiny model on the CPU and prints tokens/s and MFU; --fp8 there prints the trainer's refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.processes import run_group

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_mfu.py"


def test_the_gpu_benchmark_says_no_gpu_and_its_smoke_run_reports_tokens_per_second_and_mfu() -> None:
    root = SCRIPT.parents[1]
    bare = run_group([sys.executable, str(SCRIPT)], timeout=120, cwd=root)
    assert bare.returncode == 1 and "no GPU here: nothing measured" in bare.stdout
    smoke = run_group([sys.executable, str(SCRIPT), "--smoke", "--steps", "4", "--warmup", "1"], timeout=300, cwd=root)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert "tokens/s" in smoke.stdout and "MFU " in smoke.stdout and "fused AdamW" in smoke.stdout
    fp8 = run_group([sys.executable, str(SCRIPT), "--smoke", "--fp8"], timeout=120, cwd=root)
    assert fp8.returncode == 1 and "fp8 refused: precision.dtype=fp8: the job runs on cpu" in fp8.stdout
