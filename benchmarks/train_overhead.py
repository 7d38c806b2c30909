"""Trainer overhead and checkpoint throughput, measured side by side in one run.

For a tiny and a ~20M-parameter model, in one process on the CPU:
- tokens/s of `Trainer.fit()` (metrics, sample records, sampler, checkpoint
  hooks present but off-step: storage saves and the in-memory tier) against a bare PyTorch loop with the same model,
  batch and optimizer; runs alternate and the median of the repeats is used.
  Goal: ratio >= 0.97.
- checkpoint save and load throughput (MB/s) of `CheckpointManager` against
  the same state through plain torch and DCP's own writer, side by side:
  the verified load (commit record and signature first, then each data file's
  sha256 checked in the pass that reads it) against `torch.load`, goal >= 0.5,
  and the same load without the sha256 check; the durable save (sha256 taken
  while writing, fsync per file, commit record) against DCP's own
  `FileSystemWriter` with fsync and as many writer threads, goal >= 0.8, and
  against `torch.save`.
- the training stall of a background save (`save_async`: the state copied to
  host memory) against a blocking save of the same state. Goal: <= 0.10.
  Each kind runs once unmeasured first (first-touch costs: page cache, staging
  buffers), then the kinds alternate and the medians of the repeats are used.
- the same two loads each in a fresh process, as a resume does (one load per
  process, nothing of an earlier load in the heap): the verified load into the
  trainer's model and optimizer against `torch.load` of the same state, only
  the load timed, the two alternating; the median of --checkpoint-repeats.

Usage: python benchmarks/train_overhead.py [--repeats 3] [--checkpoint-repeats 7] [--quick] [--checkpoint-only]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import parse_spec
from training.checkpoint import CheckpointManager, SavedCheckpoint
from training.checkpoint.space import estimate, write_threads
from training.config import TrainConfig
from training.dataset import TokenDataset
from training.model import Transformer
from training.storage import StorageConfig
from training.train import Trainer, seed_everything

MODELS = {
    "tiny": {
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 172, "seq_len": 64},
        "micro_batch": 16,
        "steps": 150,
    },
    "20M": {
        "model": {"n_layers": 6, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "seq_len": 128},
        "micro_batch": 8,
        "steps": 12,
    },
}


def train_config(work: Path, dataset: str, size: str, tag: str) -> TrainConfig:
    """A one-process config for `size`, writing under work/tag."""
    m = MODELS[size]
    spec = {
        "name": "bench",
        "cluster": {"procs_per_node": 1},
        "model": {**m["model"], "vocab_size": 257},
        "parallel": {"micro_batch": m["micro_batch"]},
        "optim": {"lr_peak": 1e-3, "warmup_steps": 2},
        "data": {"dataset_url": dataset},
        # Checkpoint hooks present but off-step: the storage save and the in-memory tier (whose own goal is a stall
        # of at most 5% of a step where it runs: training/checkpoint/memory_auto.py).
        "checkpoint": {
            "url": str(work / tag / "ckpt"),
            "save_every_steps": 10_000,
            "save_at_end": False,
            "memory_every_steps": 10_000,
        },
        "run": {"steps": m["steps"], "output_url": str(work / tag / "out"), "eval_batches": 1, "log_every_steps": 50},
    }
    return parse_spec(spec).training_config()


def trainer_tokens_per_s(cfg: TrainConfig) -> float:
    """Wall-clock tokens/s of a whole fit() (start-up excluded)."""
    trainer = Trainer(cfg)
    started = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - started
    return cfg.run.steps * cfg.parallel.micro_batch * cfg.model.seq_len / elapsed


def bare_tokens_per_s(cfg: TrainConfig) -> float:
    """The same model, batch and optimizer in a nanoGPT-style loop."""
    seed_everything(cfg.run.seed)
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr_peak, betas=(0.9, 0.95), weight_decay=0.1)
    data = TokenDataset(cfg.data.dataset_url, "train", cfg.model.seq_len)
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(cfg.run.steps):
        idx = torch.randint(0, len(data), (cfg.parallel.micro_batch,), generator=gen).tolist()
        tokens = data.batch(idx)
        logits, _ = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    elapsed = time.perf_counter() - started
    return cfg.run.steps * cfg.parallel.micro_batch * cfg.model.seq_len / elapsed


GOALS = {
    "trainer": (">=", 0.97),
    "save": (">=", 0.8),
    "load": (">=", 0.5),
    "stall": ("<=", 0.10),
}


def load_child(kind: str, path: str, config_json: str) -> None:
    """In a fresh process: time one load of `path` (`plain`: torch.load; `verified`: the manager's load into a
    new trainer's model and optimizer, as a resume does) and print the seconds."""
    if kind == "plain":
        started = time.perf_counter()
        torch.load(path, weights_only=True)
    else:
        cfg = TrainConfig.model_validate_json(Path(config_json).read_text())
        trainer = Trainer(cfg)  # its own checkpoint folder is empty: nothing is resumed here
        manager = CheckpointManager(cfg.checkpoint.model_copy(update={"url": path}), StorageConfig())
        started = time.perf_counter()
        loaded = manager.load_latest(trainer.model, trainer.optimizer)
        assert loaded is not None, f"nothing loaded from {path}"
    print(f"{time.perf_counter() - started:.6f}")


def fresh_process_loads(work: Path, cfg: TrainConfig, plain: Path, dcp_dir: Path, repeats: int) -> dict[str, float]:
    """Median seconds of torch.load and of the verified load, each alone in a fresh process, alternating."""
    config_json = work / "child-config.json"
    child_cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"url": str(work / "empty")})})
    config_json.write_text(child_cfg.model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def run(kind: str, path: Path) -> float:
        done = subprocess.run([sys.executable, __file__, "--load-child", kind, str(path), str(config_json)],
                              capture_output=True, text=True, env=env, check=True)  # fmt: skip
        return float(done.stdout.strip().splitlines()[-1])

    times: dict[str, list[float]] = {"plain": [], "verified": []}
    for r in range(repeats + 1):
        for kind, path in (("plain", plain), ("verified", dcp_dir)):
            seconds = run(kind, path)
            if r > 0:
                times[kind].append(seconds)
    return {f"fresh_{k}": statistics.median(v) for k, v in times.items()}


def goal(name: str, ratio: float) -> str:
    """`ratio` with its goal beside it and whether it is met."""
    op, target = GOALS[name]
    met = ratio >= target if op == ">=" else ratio <= target
    return f"{ratio:.2f} (goal {op} {target:.2f}: {'met' if met else 'NOT met'})"


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def checkpoint_throughput(work: Path, cfg: TrainConfig, repeats: int) -> dict[str, float]:
    """Median seconds of each checkpoint operation on the same state (first runs unmeasured), and its size."""
    seed_everything(0)
    trainer = Trainer(cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": 1})}))
    trainer.fit()  # one step so the optimizer has its moments
    ckpt = cfg.checkpoint.model_copy(update={"url": str(work / "dcp"), "keep_last": 1})
    manager = CheckpointManager(ckpt, StorageConfig())
    unverified = CheckpointManager(ckpt.model_copy(update={"verify_checksums": False}), StorageConfig())
    model, optimizer = trainer.model, trainer.optimizer
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    plain = work / "plain.pt"
    steps = iter(range(1, 10_000))
    saves: list[SavedCheckpoint] = []  # the background ones
    stalls: list[float] = []  # how long save_async held its caller (the record's stall_s counts the wait after it too)

    def blocking_save() -> None:
        step = next(steps)
        manager.save(step, model, optimizer, {**trainer._train_state(), "step": step})

    def background_save() -> None:
        step = next(steps)
        started = time.perf_counter()
        manager.save_async(step, model, optimizer, {**trainer._train_state(), "step": step})
        stalls.append(time.perf_counter() - started)
        saved = manager.wait()
        assert saved is not None
        saves.append(saved)

    def durable_plain_save() -> None:
        with open(plain, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    stock = work / "stock-dcp"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    threads = write_threads(estimate({"model": model_sd, "optim": optim_sd}, 1), 1)  # as many as the manager's

    def stock_dcp_save() -> None:  # DCP's own writer, each file fsynced, no hashing, no commit record
        shutil.rmtree(stock, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(stock), sync_files=True, thread_count=threads))

    runs: dict[str, Callable[[], object]] = {
        "plain_save": lambda: torch.save(state, plain),
        "plain_save_fsync": durable_plain_save,
        "stock_dcp_save": stock_dcp_save,
        "save": blocking_save,
        "async_save": background_save,
        "plain_load": lambda: torch.load(plain, weights_only=True),
        "load": lambda: manager.load_latest(model, optimizer),
        "load_unverified": lambda: unverified.load_latest(model, optimizer),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats + 1):
        for name, fn in runs.items():
            seconds = _timed(fn)
            if r > 0:
                times[name].append(seconds)
    out = {name: statistics.median(v) for name, v in times.items()}
    out["stall"] = statistics.median(stalls[1:])
    out["first_stall"] = stalls[0]
    out["MB"] = saves[-1].nbytes / 1e6
    out["threads"] = threads
    out["plain_MB"] = plain.stat().st_size / 1e6
    out.update(fresh_process_loads(work, cfg, plain, work / "dcp", repeats))
    return out


def report_checkpoint(ck: dict[str, float], size: str) -> None:
    """Print the checkpoint figures, each ratio with its goal."""
    save, load = ck["MB"] / ck["save"], ck["MB"] / ck["load"]
    plain_save, plain_load = ck["plain_MB"] / ck["plain_save"], ck["plain_MB"] / ck["plain_load"]
    stock = ck["MB"] / ck["stock_dcp_save"]
    print(f"checkpoint of {ck['MB']:.1f} MB ({size} model + AdamW), medians of the repeats:")
    print(
        f"  load, verified (sha256 of each file checked in the pass that reads it) {load:.0f} MB/s vs torch.load "
        f"{plain_load:.0f} MB/s: ratio {goal('load', load / plain_load)}"
    )
    print(f"  load without the sha256 check: ratio {ck['MB'] / ck['load_unverified'] / plain_load:.2f} of torch.load")
    fresh = (ck["MB"] / ck["fresh_verified"]) / (ck["plain_MB"] / ck["fresh_plain"])  # throughputs, as above
    print(
        f"  in a fresh process each, as a resume loads: verified {ck['MB'] / ck['fresh_verified']:.0f} MB/s vs "
        f"torch.load {ck['plain_MB'] / ck['fresh_plain']:.0f} MB/s: ratio {fresh:.2f} (for the record: a fresh "
        f"optimizer's state is allocated for the load, without DCP's zero-lr step: training/checkpoint/optim_state.py)"
    )
    print(
        f"  durable save (sha256 taken while writing, fsync per file, commit) {save:.0f} MB/s vs DCP's "
        f"FileSystemWriter with fsync ({int(ck['threads'])} threads, no hashing or commit) {stock:.0f} MB/s: "
        f"ratio {goal('save', save / stock)}"
    )
    print(
        f"    against torch.save {plain_save:.0f} MB/s: ratio {save / plain_save:.2f}; torch.save + fsync "
        f"{ck['MB'] / ck['plain_save_fsync']:.0f} MB/s: ratio {ck['plain_save_fsync'] / ck['save']:.2f}"
    )
    print(
        f"  background save: training held {ck['stall'] * 1e3:.0f} ms vs {ck['save'] * 1e3:.0f} ms for a blocking "
        f"save: stall ratio {goal('stall', ck['stall'] / ck['save'])}; the first one held {ck['first_stall'] * 1e3:.0f}"
        f" ms (allocating its host buffers); committed {ck['async_save'] * 1e3:.0f} ms after the call; "
        f"torch.save of the same state takes {ck['MB'] / plain_save * 1e3:.0f} ms"
    )


def main() -> None:
    """Run every comparison and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side per model")
    parser.add_argument("--quick", action="store_true", help="tiny model only, 1 repeat (smoke test)")
    parser.add_argument("--checkpoint-repeats", type=int, default=7, help="alternating runs of each checkpoint kind")
    parser.add_argument("--checkpoint-only", action="store_true", help="skip the trainer tokens/s comparison")
    parser.add_argument("--load-child", nargs=3, metavar=("KIND", "PATH", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        load_child(*args.load_child)
        return
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-"))
    try:
        data = PrepareConfig(
            output_url=str(work / "data"),
            builtin_corpus="python-docs",
            builtin_max_bytes=600_000,
            tokenizer={"kind": "bytes"},
        )
        dataset = prepare_dataset(data, StorageConfig(), validate=False).dataset_url
        sizes = ["tiny"] if args.quick else list(MODELS)
        repeats = 1 if args.quick else args.repeats
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats {repeats}")
        print(f"{'model':>6} {'params':>8} {'trainer tok/s':>14} {'bare tok/s':>11} ratio")
        for size in [] if args.checkpoint_only else sizes:
            trainer_runs, bare_runs = [], []
            warm = train_config(work, dataset, size, f"{size}-warmup")
            bare_tokens_per_s(warm)  # first-touch costs (allocator, kernels) hit neither measured side
            trainer_tokens_per_s(warm)
            for r in range(repeats):
                cfg = train_config(work, dataset, size, f"{size}-{r}")
                bare_runs.append(bare_tokens_per_s(cfg))
                trainer_runs.append(trainer_tokens_per_s(cfg))
            params = Transformer(cfg.model).num_params()
            trainer_tps, bare_tps = statistics.median(trainer_runs), statistics.median(bare_runs)
            ratio = goal("trainer", trainer_tps / bare_tps)
            print(f"{size:>6} {params / 1e6:>7.1f}M {trainer_tps:>14.0f} {bare_tps:>11.0f} {ratio}")
        cfg = train_config(work, dataset, sizes[-1], "ckpt")
        report_checkpoint(
            checkpoint_throughput(work, cfg, repeats if args.quick else args.checkpoint_repeats), sizes[-1]
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
