"""Goodput of a soak under injected failures with the recovery ladder against the same soak recovering from storage
only (today's path), in one run.

Both soaks run the same job (the tiny model on 2 acted-out local nodes of one rank each, gloo, a storage checkpoint
every `--save-every` steps) for `--minutes`, under the same seeded failure schedule (`--failure-every` minutes on
average; rank kills, node losses, hangs, slow nodes and storage outages in shuffled rounds) through the soak step's
own `run_soak` (tasks/soak/run.py): the ladder's with the in-memory copies every step (rung memory), the baseline
with `checkpoint.memory_every_steps` off (rung storage). Printed per soak: goodput and each badput share
(validation/goodput.py), failures recovered, recoveries per rung, steps lost, the recovery times and the largest
memory growth of a process. The issue's goal: goodput >= 90% with the ladder over 30 minutes with a failure every
2 minutes, and 0 steps lost beyond the memory interval.

Figures are wall times on a shared machine: other processes on its cores stretch them (the load is printed).

Usage: python benchmarks/soak.py [--minutes 30] [--failure-every 2] [--seed 1] [--save-every 20] [--memory-every 1]
       [--model tiny|small] [--side-by-side] [--keep DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.soak.config import SoakConfig
from tasks.soak.report import read_report, write_report
from tasks.soak.result import SoakResult
from tasks.soak.run import run_soak
from tasks.spec import parse_spec
from training.storage import StorageConfig

GOODPUT_GOAL = 0.90
SOAKS = ("ladder", "storage")


MODELS: dict[str, tuple[dict[str, int], int]] = {
    # name: (model fields, micro batch)
    "tiny": ({"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "vocab_size": 257,
              "seq_len": 32}, 4),
    # About 3.1M parameters and 38 GFLOP a step: steps of about a second on one thread, so that a failure's fixed
    # costs (detection, restart, restore) are weighed against training time of the size real steps have.
    "small": ({"n_layers": 4, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 704, "vocab_size": 257,
               "seq_len": 256}, 8),
}  # fmt: skip


def spec_for(work: Path, dataset: str, model: str = "tiny") -> dict[str, Any]:
    """The `model` (MODELS) on 2 acted-out nodes of one rank each."""
    fields, micro_batch = MODELS[model]
    return {
        "name": "bench-soak",
        "cluster": {"scheduler": "local", "nodes": 2, "procs_per_node": 1, "accelerator": "cpu"},
        "model": fields,
        "parallel": {"sharding": "ddp", "micro_batch": micro_batch, "grad_accum_steps": 1},
        "precision": {"dtype": "fp32"},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(work / "ck"), "save_every_steps": 20, "memory_dir": str(work / "shm")},
        "run": {"steps": 20, "seed": 7, "output_url": str(work / "out"), "log_every_steps": 20,
                "threads_per_rank": 1},
    }  # fmt: skip


def row(name: str, result: SoakResult) -> list[str]:
    """One soak's figures as table cells."""
    shares = {k: v for k, v in result.goodput.shares().items() if v > 0} if result.goodput else {}
    top = ", ".join(f"{k} {v:.1%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])[:4])
    times = [f.recovery_s for f in result.failures if f.recovery_s is not None]
    grown = max((p.growth_bytes or 0 for p in result.processes), default=0)
    recovered = sum(f.recovered for f in result.failures)
    ratio = result.goodput.goodput if result.goodput else float("nan")
    return [
        name, f"{ratio:.1%}", top or "-", f"{recovered}/{len(result.failures)}",
        ", ".join(f"{k} {v}" for k, v in sorted(result.recoveries_per_rung.items())) or "-",
        str(result.steps_lost), f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-",
        f"{grown / 2**20:+.1f}", str(result.steps_trained),
    ]  # fmt: skip


def main() -> None:
    """Run the ladder's soak and the storage-only soak on the same schedule; print both side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--failure-every", type=float, default=2.0, help="mean minutes between failures")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=20, help="storage checkpoint interval (steps)")
    parser.add_argument("--memory-every", type=int, default=1, help="the ladder's in-memory copy interval (steps)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep the jobs' records (default: a temp dir)")
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the two soaks at the same time (a process each, sharing the cores) instead of one after the other: "
        "both meet the same load, and the pair takes the time of one",
    )
    parser.add_argument("--only", choices=sorted(SOAKS), help=argparse.SUPPRESS)  # a child of --side-by-side
    parser.add_argument("--dataset", help=argparse.SUPPRESS)  # the parent's prepared dataset (with --only)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started, load = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        work = args.keep or Path(tmp)
        dataset = args.dataset or prepare_dataset(
            PrepareConfig(output_url=str(work / "ds"), builtin_corpus="python-docs", builtin_max_bytes=300_000,
                          tokenizer={"kind": "bytes"}, workers=1),
            StorageConfig(), validate=False,
        ).dataset_url  # fmt: skip
        spec = parse_spec(spec_for(work, dataset, args.model), "bench-soak")
        memory = {"ladder": args.memory_every, "storage": None}
        names = {"ladder": f"ladder (memory every {args.memory_every} steps)", "storage": "storage only"}
        if args.side_by_side:
            own = [a for a in sys.argv[1:] if a != "--side-by-side"]
            children = [subprocess.Popen([sys.executable, __file__, *own, "--keep", str(work), "--only", key,
                                          "--dataset", dataset]) for key in SOAKS]  # fmt: skip
            codes = [child.wait() for child in children]
            if any(codes):
                sys.exit(f"a soak's process failed: exit codes {codes}")
            results = {names[key]: read_report(work / key) for key in SOAKS}
        else:
            results = {}
            for key in [args.only] if args.only else SOAKS:
                cfg = SoakConfig(hours=args.minutes / 60, failure_every_min=args.failure_every, seed=args.seed,
                                 save_every_steps=args.save_every, memory_every_steps=memory[key])  # fmt: skip
                results[names[key]] = write_report(run_soak(spec.cluster, spec.training_config(), cfg, work / key),
                                                   work / key)  # fmt: skip
            if args.only:
                return
    header = ["soak", "goodput", "largest badput shares", "recovered", "by rung", "steps lost",
              "recovery s (median / max)", "max RSS growth MiB", "steps"]  # fmt: skip
    table = [header, *(row(name, result) for name, result in results.items())]
    widths = [max(len(r[k]) for r in table) for k in range(len(header))]
    for cells in table:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
    ladder = next(iter(results.values()))
    kinds = ", ".join(f.kind for f in ladder.failures)
    ratio = ladder.goodput.goodput if ladder.goodput else 0.0
    print(f"\nmodel {args.model}, storage save every {args.save_every} steps; schedule (seed {args.seed}, "
          f"{args.minutes:g} min, a failure every {args.failure_every:g} min on "
          f"average): {kinds or 'none'}; left out: {ladder.left_out or 'none'}")
    print(f"goal: ladder goodput >= {GOODPUT_GOAL:.0%}: {'met' if ratio >= GOODPUT_GOAL else 'NOT met'} "
          f"({ratio:.1%}); problems: {[p for r in results.values() for p in r.problems] or 'none'}")
    print(f"{os.cpu_count()} cores, load {load:.1f} -> {os.getloadavg()[0]:.1f}, "
          f"{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
