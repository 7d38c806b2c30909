"""Noise of the correctness comparison, and how far the faults it must catch stand above it.

Runs the acceptance suite's correctness pair (tasks/acceptance/suite.py `correctness_plan`): a 2-rank DDP job
with gradient accumulation 2 in fp32 without dropout, against the independent reference
(training/reference.py), both `--steps` steps of a `--schedule-steps` schedule. It prints, per step and as the
maximum over steps 1..k, the relative loss deviation |distributed - reference| / reference of

- three clean runs (the noise: summation order of the all-reduce and of the batched matmuls),
- one rank initialised and shuffled with another seed (test fault seed_offset_rank),
- no gradient synchronisation at all (test fault skip_grad_sync),
- only the last micro-batch's gradient counting (test fault accum_bug),

and each fault's ratio to the worst clean deviation. The acceptance defaults (reference_steps,
correctness_max_rel_deviation) are chosen from these figures: every fault above the tolerance, the tolerance
above the clean noise, fault / clean >= 10.

Usage: python benchmarks/acceptance_noise.py [--shape tiny|local] [--steps 10] [--schedule-steps 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tasks.acceptance.suite import correctness_plan
from tasks.acceptance.workspace import Job, RunOutcome
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import parse_spec
from tests.faults.job import injected
from training.storage import StorageConfig
from validation.acceptance import FP32_EPS, AcceptanceThresholds

SHAPES: dict[str, dict[str, Any]] = {
    # tests/conftest.py TINY_SPEC's model
    "tiny": {
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 32},
        "parallel": {"micro_batch": 4},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2},
        "seed": 7,
    },
    # examples/local.yaml's model and optimizer (on the byte-level corpus: vocabulary 2048 > 257 bytes)
    "local": {
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 172, "seq_len": 64},
        "parallel": {"micro_batch": 4},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 10},
        "seed": 1234,
    },
}
FAULTS: dict[str, dict[str, Any]] = {
    "seed_offset_rank": {"seed_offset_rank": 1},
    "skip_grad_sync": {"skip_grad_sync": True},
    "accum_bug": {"accum_bug": True},
}


def spec_for(shape: str, work: Path, dataset: str, schedule_steps: int) -> Any:
    """A 2-rank CPU spec of `shape` with grad_accum_steps 2."""
    s = SHAPES[shape]
    vocab = 2048 if shape == "local" else 257
    return parse_spec(
        {
            "name": "noise",
            "cluster": {"scheduler": "local", "nodes": 1, "procs_per_node": 2, "accelerator": "cpu"},
            "model": {**s["model"], "vocab_size": vocab},
            "parallel": {"sharding": "ddp", **s["parallel"], "grad_accum_steps": 2},
            "optim": {**s["optim"], "schedule": "cosine"},
            "data": {"dataset_url": dataset},
            "checkpoint": {"url": str(work / "ckpt")},
            "run": {"steps": schedule_steps, "seed": s["seed"], "output_url": str(work / "out"), "threads_per_rank": 1},
        }
    )


def deviations(dist: RunOutcome, reference: RunOutcome) -> list[float]:
    """Relative loss deviation per step (1..k) of `dist` from `reference`."""
    d, r = dist.metrics(), reference.metrics()
    return [abs(d[s].loss - r[s].loss) / abs(r[s].loss) for s in sorted(set(d) & set(r))]


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=10, help="steps compared (acceptance.reference_steps)")
    parser.add_argument("--schedule-steps", type=int, default=200, help="run.steps of the schedule (acceptance.steps)")
    parser.add_argument("--clean-runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-noise-"))
    try:
        os.environ.setdefault("TDEPLOY_CACHE_DIR", str(work / "cache"))
        dataset = prepare_dataset(
            PrepareConfig(
                output_url=str(work / "dataset"),
                builtin_corpus="python-docs",
                builtin_max_bytes=300_000,
                tokenizer={"kind": "bytes"},
                workers=1,
            ),
            StorageConfig(),
            validate=False,
        ).dataset_url
        spec = spec_for(args.shape, work, dataset, args.schedule_steps)
        train = spec.training_config()
        train = train.model_copy(update={"model": train.model.model_copy(update={"dropout": 0.1})})
        runs: dict[str, list[float]] = {}
        reference = None
        cases = [(f"clean-{i + 1}", {}) for i in range(args.clean_runs)] + list(FAULTS.items())
        for name, faults in cases:
            plan = correctness_plan(spec.cluster, train, work / name, args.schedule_steps, args.steps)
            assert plan.distributed is not None  # dropout 0.1 in `train`: the pair has a distributed run
            if reference is None:  # deterministic and fault-free: one is enough
                reference = Job(plan.reference_cluster, plan.reference, "reference", None, None).wait(600)
            env = injected(**faults) if faults else None
            dist = Job(spec.cluster, plan.distributed, name, env, None).wait(600)
            runs[name] = deviations(dist, reference)
        clean = max(max(v) for k, v in runs.items() if k.startswith("clean")) or 1e-300  # bit-exact: no noise
        factor = AcceptanceThresholds().correctness_noise_factor
        tolerance = factor * max(clean, FP32_EPS)  # as acceptance derives it, with the clean runs as the noise
        print(f"shape={args.shape} grad_accum_steps=2 world=2 steps={args.steps} schedule={args.schedule_steps}")
        print(f"tolerance (correctness_noise_factor {factor:g} x the clean maximum) {tolerance:g}")
        for name, devs in runs.items():
            worst = max(devs)
            ratio = (
                "" if name.startswith("clean") else f"  {worst / clean:.3g}x clean, {worst / tolerance:.3g}x tolerance"
            )
            curve = " ".join(f"{d:.1e}" for d in devs)
            print(f"{name:18s} max {worst:.3e}{ratio}\n{'':18s} per step {curve}")
        first = {name: next((s + 1 for s, d in enumerate(devs) if d > tolerance), None) for name, devs in runs.items()}
        print("first step above the tolerance:", {k: v for k, v in first.items() if k in FAULTS})
    finally:
        if args.keep:
            print("work folder:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
