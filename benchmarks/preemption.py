"""Graceful preemption: seconds from the signal to the job's exit, and steps lost, beside one blocking checkpoint
save of the same model, measured side by side in the same jobs.

Each repeat starts a 2-rank CPU job (gloo) under torchrun through the local launcher, saving a checkpoint every
`--save-every` steps; once it has run a few steps, the launcher delivers SIGTERM (or SIGUSR1) to the agents as a
scheduler does. Measured from outside: signal to the last agent's exit (the launcher's view, which polls every
10 ms), and from inside: the trainer's own signal_to_exit_s (preemptions.jsonl). Steps lost = steps the ranks
completed minus the step of the checkpoint the job left (goal: 0). The save time is the median `seconds` of the
scheduled saves of the same job (checkpoints.jsonl): ratio = signal-to-exit / one save.

Usage: python benchmarks/preemption.py [--repeats 2] [--signal SIGTERM] [--d-model 256]
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import tempfile
import time
from pathlib import Path

from tasks.launch.local import running_agents, start_local
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import parse_spec
from training.preemption import read_records
from training.run_output import RunOutput, read_jsonl
from training.storage import StorageConfig


def spec_for(work: Path, dataset: str, tag: str, d_model: int, save_every: int) -> dict:
    """A 2-rank CPU job of a model with `d_model` (6 layers) that runs far longer than the benchmark waits."""
    return {
        "name": "bench-preemption",
        "cluster": {"procs_per_node": 2},
        "model": {"n_layers": 6, "d_model": d_model, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 4 * d_model,
                  "seq_len": 64, "vocab_size": 257},
        "parallel": {"micro_batch": 4},
        "optim": {"lr_peak": 1e-3, "warmup_steps": 2},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(work / tag / "ck"), "save_every_steps": save_every, "keep_last": 2},
        "run": {"steps": 100_000, "output_url": str(work / tag / "out"), "log_every_steps": 1000, "seed": 1},
    }  # fmt: skip


def one(work: Path, dataset: str, tag: str, sig: signal.Signals, d_model: int, save_every: int) -> dict:
    """Run one job to its preemption; the figures of that run."""
    spec = parse_spec(spec_for(work, dataset, tag, d_model, save_every), tag)
    job = start_local(spec.cluster, spec.training_config(), name=tag)
    out = RunOutput(job.output_dir)
    deadline = time.monotonic() + 600
    while not (job.output_dir / "checkpoints.jsonl").exists() or out.last_step() < 2 * save_every + 1:
        if time.monotonic() > deadline or job.status().state.terminal:
            raise RuntimeError(f"{tag}: the job did not get going: {job.log_tail()}")
        time.sleep(0.05)
    signalled = time.monotonic()
    job.launcher.signal(job.handle, sig)
    while running_agents(job.handle):
        time.sleep(0.01)
    exited = time.monotonic() - signalled
    status = job.status()
    [record] = read_records(str(job.output_dir))
    saves = [e["seconds"] for e in read_jsonl(job.output_dir / "checkpoints.jsonl") if e["step"] != record.step]
    steps = [r.step_time_s for r in out.metric_records(0)]
    return {
        "state": status.state.value,
        "exit_s": exited,
        "inner_s": record.signal_to_exit_s,
        "lost": out.last_step() - record.step,
        "save_s": statistics.median(saves),
        "step_s": statistics.median(steps),
        "mb": next(e["bytes"] for e in read_jsonl(job.output_dir / "checkpoints.jsonl")) / 1e6,
    }


def main() -> None:
    """Run the repeats and print the figures and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--signal", choices=["SIGTERM", "SIGUSR1", "both"], default="both")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    signals = [signal.SIGTERM, signal.SIGUSR1] if args.signal == "both" else [signal.Signals[args.signal]]
    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as tmp:
        work = Path(tmp)
        dataset = prepare_dataset(
            PrepareConfig(output_url=str(work / "ds"), builtin_corpus="python-docs", builtin_max_bytes=300_000,
                          tokenizer={"kind": "bytes"}, workers=1),
            StorageConfig(), validate=False,
        ).dataset_url  # fmt: skip
        print(f"{'signal':8} {'state':10} {'ckpt MB':>8} {'step s':>7} {'save s':>7} {'exit s':>7} {'trainer s':>9} "
              f"{'exit/save':>9} {'lost':>4}")  # fmt: skip
        for sig in signals:
            for repeat in range(args.repeats):
                r = one(work, dataset, f"{sig.name.lower()}-{repeat}", sig, args.d_model, args.save_every)
                print(f"{sig.name:8} {r['state']:10} {r['mb']:8.1f} {r['step_s']:7.3f} {r['save_s']:7.3f} "
                      f"{r['exit_s']:7.2f} {r['inner_s']:9.2f} {r['exit_s'] / r['save_s']:9.1f} {r['lost']:4d}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
