"""Cost of the data step for a dataset given by URL: the token suite over the whole dataset, and its cached rerun.

A synthetic dataset (uint16 ids, documents of 1,000 tokens, shards of 16 Mi tokens) is written locally.
Printed:
- the streaming scan alone (`dataset_tables(..., documents=False)`: sha256, id range, index) in tokens/s and
  MB/s, against a bare `sha256_file` pass over the same files (the floor any checksum check pays);
- its peak traced memory (tracemalloc), against the largest shard's size;
- the whole data step (`check_dataset_url`: scan, Great Expectations suite, reports) and the rerun that reuses
  the cached verdict.

Usage: python benchmarks/dataset_url_check.py [--tokens 200000000]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pandas  # noqa: F401 - imported up front, so that the scan's timing leaves the import out

from tasks.prepare.config import DataSpec
from tasks.prepare.existing import check_dataset_url
from training.dataset import DatasetWriter, TokenizerInfo, read_manifest
from training.storage import StorageConfig, filesystem, join, sha256_file
from validation.data import dataset_tables

VOCAB = 32_000
DOC_TOKENS = 1_000


def _write(url: str, n_tokens: int) -> None:
    rng = np.random.default_rng(0)
    docs = n_tokens // (DOC_TOKENS + 1)
    with DatasetWriter(url, VOCAB, TokenizerInfo(kind="bytes"), eos_id=VOCAB - 1, shard_tokens=1 << 24) as writer:
        for start in range(0, docs, 1000):
            batch = [rng.integers(0, VOCAB - 1, DOC_TOKENS) for _ in range(min(1000, docs - start))]
            writer.add_documents("train" if start % 20_000 else "val", batch)


def main() -> None:
    """Write the dataset, then time each part."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000_000, help="tokens in the synthetic dataset")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-urlcheck-"))
    try:
        url = str(work / "dataset")
        _write(url, args.tokens)
        manifest = read_manifest(url)
        shards = [s for split in manifest.splits.values() for s in split.shards]
        n_tokens = sum(s.n_tokens for s in shards)
        size = sum(s.n_tokens * 2 + (s.n_docs + 1) * 8 for s in shards)
        fs, root = filesystem(url)

        t0 = time.perf_counter()
        for s in shards:
            sha256_file(fs, join(root, s.tokens))
            sha256_file(fs, join(root, s.index))
        floor = time.perf_counter() - t0

        t0 = time.perf_counter()
        dataset_tables(url, vocab_size=VOCAB, documents=False)
        scan = time.perf_counter() - t0
        tracemalloc.start()
        dataset_tables(url, vocab_size=VOCAB, documents=False)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

        data = DataSpec(dataset_url=url)
        t0 = time.perf_counter()
        first = check_dataset_url(data, VOCAB, StorageConfig(), str(work / "reports"))
        step = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = check_dataset_url(data, VOCAB, StorageConfig(), str(work / "reports"))
        cached = time.perf_counter() - t0
        assert first.validation["success"] and again.cached

        largest = max(s.n_tokens for s in shards) * 2
        print(f"dataset: {n_tokens:,} tokens in {len(shards)} shards, {size / 1e6:.0f} MB")
        print(f"sha256 alone:   {floor:.2f} s ({size / 1e6 / floor:.0f} MB/s)")
        print(f"streaming scan: {scan:.2f} s ({n_tokens / scan / 1e6:.1f} M tokens/s, {size / 1e6 / scan:.0f} MB/s; "
              f"{scan / floor:.2f}x sha256 alone)")  # fmt: skip
        print(f"scan peak traced memory: {peak / 2**20:.1f} MiB (largest shard {largest / 2**20:.0f} MiB)")
        print(f"data step (scan + GE suite + report): {step:.2f} s; rerun with the cached verdict: {cached:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
