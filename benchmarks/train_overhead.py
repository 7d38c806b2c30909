"""Trainer overhead and checkpoint throughput, measured side by side in one run.

For a tiny and a ~20M-parameter model, in one process on the CPU:
- tokens/s of `Trainer.fit()` (metrics, sample records, sampler, checkpoint
  hooks present but off-step) against a bare PyTorch loop with the same model,
  batch and optimizer; runs alternate and the median of the repeats is used.
  Goal: ratio >= 0.95.
- checkpoint save and load throughput (MB/s) of `CheckpointManager` (DCP,
  sha256 of every file, commit marker; load verifies before reading) against a
  plain `torch.save`/`torch.load` of the same state to the same disk.

Usage: python benchmarks/train_overhead.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import parse_spec
from training.checkpoint import CheckpointManager
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
        "checkpoint": {"url": str(work / tag / "ckpt"), "save_every_steps": 10_000, "save_at_end": False},
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


def checkpoint_throughput(work: Path, cfg: TrainConfig) -> dict[str, float]:
    """MB/s of CheckpointManager save/load against torch.save/torch.load of the same state."""
    seed_everything(0)
    trainer = Trainer(cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": 1})}))
    trainer.fit()  # one step so the optimizer has its moments
    manager = CheckpointManager(cfg.checkpoint.model_copy(update={"url": str(work / "dcp")}), StorageConfig())
    state = {"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict()}

    started = time.perf_counter()
    nbytes = manager.save(1, trainer.model, trainer.optimizer, trainer._train_state())
    dcp_save = time.perf_counter() - started
    started = time.perf_counter()
    manager.load_latest(trainer.model, trainer.optimizer)
    dcp_load = time.perf_counter() - started
    unverified = CheckpointManager(manager.cfg.model_copy(update={"verify_checksums": False}), StorageConfig())
    started = time.perf_counter()
    unverified.load_latest(trainer.model, trainer.optimizer)
    dcp_load_unverified = time.perf_counter() - started

    plain = work / "plain.pt"
    started = time.perf_counter()
    torch.save(state, plain)
    plain_save = time.perf_counter() - started
    plain_bytes = plain.stat().st_size
    started = time.perf_counter()
    torch.load(plain, weights_only=True)
    plain_load = time.perf_counter() - started
    mb = 1e6
    return {
        "dcp_save_MBps": nbytes / mb / dcp_save,
        "dcp_load_MBps": nbytes / mb / dcp_load,
        "dcp_load_unverified_MBps": nbytes / mb / dcp_load_unverified,
        "plain_save_MBps": plain_bytes / mb / plain_save,
        "plain_load_MBps": plain_bytes / mb / plain_load,
        "MB": nbytes / mb,
    }


def main() -> None:
    """Run every comparison and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side per model")
    parser.add_argument("--quick", action="store_true", help="tiny model only, 1 repeat (smoke test)")
    args = parser.parse_args()
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
        print(f"{'model':>6} {'params':>8} {'trainer tok/s':>14} {'bare tok/s':>11} {'ratio':>6}")
        for size in sizes:
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
            print(
                f"{size:>6} {params / 1e6:>7.1f}M {trainer_tps:>14.0f} {bare_tps:>11.0f} {trainer_tps / bare_tps:>6.3f}"
            )
        cfg = train_config(work, dataset, sizes[-1], "ckpt")
        ck = checkpoint_throughput(work, cfg)
        print(
            f"checkpoint of {ck['MB']:.1f} MB ({sizes[-1]} model + AdamW): "
            f"save {ck['dcp_save_MBps']:.0f} MB/s vs torch.save {ck['plain_save_MBps']:.0f} MB/s "
            f"(ratio {ck['dcp_save_MBps'] / ck['plain_save_MBps']:.2f}); "
            f"load {ck['dcp_load_MBps']:.0f} MB/s vs torch.load {ck['plain_load_MBps']:.0f} MB/s "
            f"(ratio {ck['dcp_load_MBps'] / ck['plain_load_MBps']:.2f}; "
            f"{ck['dcp_load_unverified_MBps']:.0f} MB/s without the sha256 check)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
