"""Capacity estimator: predicted vs measured peak memory and step time, and the speed of the plan search.

1. For a grid of the payload's model sizes and settings (precision, recompute, DDP/FSDP, MoE), measure one
   rank's training-step peak on this machine (fake tensors under torch's MemTracker; real tensors for MoE) and
   print it beside the estimate with the relative error. Goal: within 10% for every configuration.
2. For the grid's one-process configurations, time the real training step on this CPU (median of 5 after one
   untimed step) beside the planner's step time on the catalogue's `cpu` entry: the raw ratio, then the error
   after calibrating with the median ratio per dtype (what the ledger's calibration does per accelerator from
   accepted runs; the catalogue has one figure per dtype, which this CPU's matmul units may beat or miss).
3. Time plan searches: over more than 10^4 layouts (GPT-3 175B on 768 A100s, global batch 1536; goal: under one
   second) and over the larger space with context parallelism (GPT-3 175B on 768 A100s, Llama 3.1 70B on 1,024
   H100s; goal: 10^5 layouts in under 2 s).

Usage: python benchmarks/capacity_accuracy.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.measure import MeasureCase, compare, predict_step, time_step
from tasks.capacity.memory import MemoryModel, Precision
from tasks.capacity.params import PRESETS
from tasks.capacity.search import Estimator, enumerate_layouts, search
from training.config import ModelConfig, MoEConfig

SIZES = {
    "tiny": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 172, "vocab_size": 257},
    "small": {"n_layers": 4, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 688, "vocab_size": 4096},
    "20M": {"n_layers": 6, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "vocab_size": 257},
    "110M": {"n_layers": 12, "d_model": 768, "n_heads": 12, "n_kv_heads": 4, "ffn_hidden": 2048, "vocab_size": 32000},
}
GOAL_ERROR = 0.10
GOAL_SEARCH_S = 1.0
GOAL_LARGE_SEARCH_S_PER_1E5 = 2.0


def grid(quick: bool) -> list[MeasureCase]:
    """The configurations to measure."""
    cases = []
    for size, seq, batch in (("tiny", 64, 8), ("small", 256, 4), ("20M", 128, 8), ("110M", 512, 2)):
        if quick and size in ("20M", "110M"):
            continue
        model = ModelConfig(**SIZES[size], seq_len=seq)
        for dtype in ("fp32", "bf16"):
            for recompute in ("none", "selective", "full"):
                cases.append(MeasureCase(model, batch, dtype, recompute, label=f"{size} {dtype} ddp {recompute}"))
        cases.append(MeasureCase(model, batch, "fp32", "none", "fsdp", 4, label=f"{size} fp32 fsdp x4 none"))
        cases.append(MeasureCase(model, batch, "bf16", "full", "fsdp", 8, label=f"{size} bf16 fsdp x8 full"))
        cases.append(MeasureCase(model, batch, "fp32", "none", grad_accum=4, label=f"{size} fp32 ddp accum4"))
    moe = ModelConfig(**SIZES["tiny"], seq_len=64, moe=MoEConfig(n_experts=4, top_k=2))
    cases.append(MeasureCase(moe, 4, "fp32", "none", label="tiny moe4 top2 fp32"))
    cases.append(MeasureCase(moe, 4, "bf16", "selective", label="tiny moe4 top2 bf16 selective"))
    gelu = ModelConfig(**{**SIZES["small"], "ffn_hidden": 1024}, seq_len=128, mlp="gelu", tie_embeddings=True)
    cases.append(MeasureCase(gelu, 4, "fp32", "none", label="small gelu tied fp32"))
    cases.append(MeasureCase(ModelConfig(**SIZES["20M"], seq_len=32), 1, label="20M mb1 s32 (optimizer peak)"))
    return cases


def accuracy(quick: bool) -> float:
    """Print predicted vs measured for the grid; return the worst absolute error."""
    print(f"{'configuration':34s} {'predicted MiB':>14s} {'measured MiB':>13s} {'error':>8s}  peak phase (predicted)")
    errors = []
    for case in grid(quick):
        result = compare(case)
        errors.append(abs(result.error))
        print(
            f"{result.label:34s} {result.predicted_peak / 2**20:14.2f} {result.measured_peak / 2**20:13.2f} "
            f"{result.error:+8.2%}  {result.predicted_phase} ({result.seconds:.1f} s to measure)"
        )
    worst = max(errors)
    verdict = "met" if worst <= GOAL_ERROR else "MISSED"
    print(
        f"{len(errors)} configurations: worst |error| {worst:.2%}, median {statistics.median(errors):.2%}; "
        f"goal <= {GOAL_ERROR:.0%}: {verdict}"
    )
    return worst


def step_times(quick: bool) -> None:
    """Print measured vs predicted step time of the one-process configurations, raw and calibrated per dtype."""
    cases = [c for c in grid(quick) if c.sharding == "ddp" and c.world == 1 and c.model.moe is None]
    rows = []
    for case in cases:
        measured, predicted = time_step(case), predict_step(case)
        rows.append((case, measured, predicted))
    scale = {
        dtype: statistics.median(m / p.total for c, m, p in rows if c.dtype == dtype)
        for dtype in {c.dtype for c, _, _ in rows}
    }
    print(f"\n{'configuration':34s} {'predicted s':>12s} {'measured s':>11s} {'ratio':>7s} {'calibrated err':>15s}")
    errors = []
    for case, measured, predicted in rows:
        calibrated = predicted.total * scale[case.dtype]
        errors.append(abs(calibrated - measured) / measured)
        print(
            f"{case.label:34s} {predicted.total:12.4g} {measured:11.4g} {measured / predicted.total:7.3f} "
            f"{(calibrated - measured) / measured:+15.1%}"
        )
    scales = ", ".join(f"{d} x{s:.3g}" for d, s in sorted(scale.items()))
    print(
        f"{len(rows)} configurations: calibration (median measured/predicted) {scales}; after it worst |error| "
        f"{max(errors):.1%}, median {statistics.median(errors):.1%}"
    )


def fresh_estimator(preset: str, accelerator: str) -> Estimator:
    """A new estimator (nothing memoised from an earlier repeat): bf16 master weights, 8 GPUs a node, 90% usable."""
    arch, acc = PRESETS[preset], CATALOGUE[accelerator]
    return Estimator(
        arch, MemoryModel(arch, Precision.of("bf16", "master-weights")), acc, 8, acc.memory_bytes * 0.9, 0.4
    )


def large_search_speed(repeats: int = 3) -> None:
    """Time the plan search over the larger layout spaces (context parallelism included)."""
    spaces = [
        ("gpt3-175b", "a100-80gb", 768, 1536),
        ("llama-3.1-70b", "h100-sxm", 1024, 1024),
    ]
    for preset, accelerator, world, batch in spaces:
        arch = PRESETS[preset]
        times = []
        for _ in range(repeats):
            est = fresh_estimator(preset, accelerator)
            started = time.perf_counter()
            result = search(est, enumerate_layouts(arch, world, 8, global_batch=batch, context_parallel=True))
            times.append(time.perf_counter() - started)
        best = min(times)
        per = best / result.evaluated * 1e5
        verdict = "met" if per < GOAL_LARGE_SEARCH_S_PER_1E5 else "MISSED"
        print(
            f"plan search {preset} on {world} {accelerator} with context parallel: {result.evaluated:,} layouts in "
            f"{best:.3f} s (median {statistics.median(times):.3f} s of {repeats}) = {per:.2f} s per 10^5 layouts; "
            f"{result.fitting_count:,} fit; goal < {GOAL_LARGE_SEARCH_S_PER_1E5} s per 10^5: {verdict}"
        )


def search_speed(repeats: int = 3) -> float:
    """Time the plan search over the GPT-3 layout space; return the best time."""
    arch = PRESETS["gpt3-175b"]
    times = []
    for _ in range(repeats):
        est = fresh_estimator("gpt3-175b", "a100-80gb")
        started = time.perf_counter()
        result = search(est, enumerate_layouts(arch, 768, 8, global_batch=1536))
        times.append(time.perf_counter() - started)
    best = min(times)
    verdict = "met" if best < GOAL_SEARCH_S else "MISSED"
    top = result.fitting[0]
    print(
        f"plan search: {result.evaluated:,} layouts (enumerate + evaluate + rank) in {best:.3f} s "
        f"(median {statistics.median(times):.3f} s of {repeats}); {result.fitting_count:,} fit; "
        f"best {top.layout.describe()} at {top.step_seconds:.2f} s/step, MFU {top.mfu:.1%}; "
        f"goal < {GOAL_SEARCH_S} s: {verdict}"
    )
    return best


def main() -> None:
    """Run every part."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 20M and 110M models")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    accuracy(args.quick)
    step_times(args.quick)
    search_speed()
    large_search_speed()


if __name__ == "__main__":
    main()
