"""What the issue-12 hardening costs, measured side by side in one run.

- Checkpoint load: `CheckpointManager.load_latest` (allow-listed unpickler, COMMIT.json HMAC, sha256 of every
  file, JSON checks) against a bare `dcp.load` of the same checkpoint (pickle, no checks); the same with
  TDEPLOY_CHECKPOINT_KEY set, and without the sha256 pass. Save with the key against save without it.
- Dataset open: `TokenDataset` on first use on this host (sizes, sha256 and token-id range of every shard), then
  with the host's trust marker present (sizes only), against a bare sha256 pass over the same files.
- Spec read: `load_spec` of examples/local.yaml (bounded UTF-8 YAML without aliases, credential walk, every
  bound), in ms per spec.
- Lease: acquire + release of a local lease, in ms.

Usage: python benchmarks/hardening_overhead.py [--repeats 5] [--mb 200]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import load_spec
from training.checkpoint import CheckpointManager
from training.config import CheckpointConfig
from training.dataset import TokenDataset
from training.lease import Lease
from training.storage import StorageConfig

REPO = Path(__file__).resolve().parents[1]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def checkpoint_figures(work: Path, mb: int, repeats: int) -> dict[str, float]:
    """Seconds of checkpoint saves and loads with and without the hardening."""
    width = int((mb * 1e6 / 4 / 3 / 8) ** 0.5)  # AdamW: weights + two moments, 8 square layers
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    out: dict[str, float] = {}
    for signed in (False, True):
        if signed:
            os.environ["TDEPLOY_CHECKPOINT_KEY"] = "benchmark-key-0123456789"
        else:
            os.environ.pop("TDEPLOY_CHECKPOINT_KEY", None)
        url = work / f"ckpt-{'signed' if signed else 'plain'}"
        manager = CheckpointManager(CheckpointConfig(url=str(url), keep_last=1), StorageConfig())
        step = iter(range(1, 10_000))
        out[f"save_s_{'signed' if signed else 'unsigned'}"] = timed(
            lambda m=manager, s=step: m.save((n := next(s)), model, optimizer, {"step": n}), repeats
        )
        out[f"load_s_{'signed' if signed else 'unsigned'}"] = timed(
            lambda m=manager: m.load_latest(model, optimizer), repeats
        )
        if not signed:  # the allow-listed unpickler and JSON checks alone, without the sha256 pass
            unverified = CheckpointManager(manager.cfg.model_copy(update={"verify_checksums": False}), StorageConfig())
            out["load_s_unverified"] = timed(lambda m=unverified: m.load_latest(model, optimizer), repeats)
        newest = max(p for p in url.iterdir() if p.name.startswith("step-"))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        out[f"bare_load_s_{'signed' if signed else 'unsigned'}"] = timed(
            lambda p=newest, sd={"model": model_sd, "optim": optim_sd}: dcp.load(sd, checkpoint_id=str(p)), repeats
        )
        out["MB"] = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 1e6
    os.environ.pop("TDEPLOY_CHECKPOINT_KEY", None)
    return out


def dataset_figures(work: Path, repeats: int) -> dict[str, float]:
    """Seconds of a dataset's first-use open, a trusted open and a bare sha256 of its files."""
    cfg = PrepareConfig(
        output_url=str(work / "data"),
        builtin_corpus="python-docs",
        builtin_max_bytes=8_000_000,
        tokenizer={"kind": "bytes"},
        workers=1,
    )
    url = prepare_dataset(cfg, StorageConfig(), validate=False).dataset_url
    files = [p for p in Path(url).rglob("*") if p.is_file() and p.name != "manifest.json"]

    def bare_sha256() -> None:
        for path in files:
            hashlib.sha256(path.read_bytes()).hexdigest()

    caches = iter(range(10_000))

    def open_both(cache: Path) -> None:
        for split in ("train", "val"):
            TokenDataset(url, split, 256, vocab_size=257, cache_dir=cache)

    open_both(work / "cache-trusted")  # warms the page cache for every side and trusts the files once
    return {
        "MB": sum(p.stat().st_size for p in files) / 1e6,
        "bare_sha256_s": timed(bare_sha256, repeats),
        "first_use_s": timed(lambda: open_both(work / f"cache-{next(caches)}"), repeats),
        "trusted_s": timed(lambda: open_both(work / "cache-trusted"), repeats),
    }


def main() -> None:
    """Run every comparison and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side (median)")
    parser.add_argument("--mb", type=int, default=200, help="checkpoint size in MB (model + AdamW state)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tdeploy-bench-") as tmp:
        work = Path(tmp)
        ck = checkpoint_figures(work, args.mb, args.repeats)
        print(f"checkpoint of {ck['MB']:.0f} MB (median of {args.repeats}):")
        for kind in ("unsigned", "signed"):
            print(
                f"  {kind:8s} load {ck[f'load_s_{kind}']:.3f} s vs bare dcp.load {ck[f'bare_load_s_{kind}']:.3f} s: "
                f"ratio {ck[f'bare_load_s_{kind}'] / ck[f'load_s_{kind}']:.2f} of bare speed"
            )
        print(
            f"  unsigned load without the sha256 pass {ck['load_s_unverified']:.3f} s: ratio "
            f"{ck['bare_load_s_unsigned'] / ck['load_s_unverified']:.2f} of bare speed"
        )
        print(f"  signed save / unsigned save: {ck['save_s_signed'] / ck['save_s_unsigned']:.3f} (time ratio)")
        ds = dataset_figures(work, args.repeats)
        print(f"dataset of {ds['MB']:.1f} MB:")
        print(
            f"  first-use open {ds['first_use_s']:.3f} s vs bare sha256 {ds['bare_sha256_s']:.3f} s: "
            f"time ratio {ds['first_use_s'] / ds['bare_sha256_s']:.2f}"
        )
        print(
            f"  trusted open {ds['trusted_s'] * 1e3:.1f} ms: {ds['trusted_s'] / ds['first_use_s']:.3f} of a first use"
        )
        spec_s = timed(lambda: load_spec(REPO / "examples" / "local.yaml"), args.repeats * 4)
        print(f"spec read and validation: {spec_s * 1e3:.1f} ms per spec")
        lease_s = timed(lambda: Lease(str(work / "lease-root"), StorageConfig()).acquire().release(), args.repeats * 4)
        print(f"lease acquire + release (local): {lease_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
