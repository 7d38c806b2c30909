"""Throughput of the data-preparation step against the bare tokenizer, measured side by side.

A jsonl corpus is made from the standard library's documentation (copies
numbered so that de-duplication keeps them); a BPE tokenizer is trained once
and given to the step as a file, so both sides encode with the same tokenizer.
Printed, for 1 and 2 workers:
- tokens/s of the whole step (read, clean, split, tokenize, shard, index, write),
  validation excluded, against `Tokenizer.encode_batch` on the same texts in memory;
  goal: ratio >= 0.70;
- the time the two Great Expectations suites add on top; goal: <= 20%.

Usage: python benchmarks/prepare_data.py [--copies 6]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from tasks.prepare.config import PrepareConfig, TokenizerConfig
from tasks.prepare.corpus import stdlib_documents
from tasks.prepare.pipeline import prepare_dataset
from tasks.prepare.tokenizer import train_bpe
from training.storage import StorageConfig


def main() -> None:
    """Build the corpus, then time both sides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=6, help="numbered copies of the ~1 MB documentation corpus")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-prepare-"))
    try:
        docs = [d for d in stdlib_documents(1_000_000) if len(d.strip()) >= 32]
        texts = [f"{doc}\n[copy {c}]" for c in range(args.copies) for doc in docs]
        source = work / "corpus.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        tok_cfg = TokenizerConfig(vocab_size=4096)
        tokenizer = train_bpe(iter(docs), tok_cfg)
        (work / "tokenizer.json").write_text(tokenizer.json_text)
        from validation.data import SuiteRunner

        SuiteRunner()  # import Great Expectations outside the timed region

        started = time.perf_counter()
        encoded = tokenizer._hf.encode_batch_fast(texts, add_special_tokens=False)
        bare_s = time.perf_counter() - started
        bare_tokens = sum(len(e.ids) for e in encoded)
        print(f"corpus: {len(texts):,} documents, {source.stat().st_size / 1e6:.1f} MB, {bare_tokens:,} tokens")
        print(f"bare encode_batch: {bare_tokens / bare_s:,.0f} tokens/s")
        print(f"{'workers':>7} {'step tok/s':>11} {'ratio':>6} {'validation +%':>14}  stages (s)")
        for workers in (1, 2):
            cfg = PrepareConfig(
                output_url=str(work / f"out-{workers}"),
                sources=[{"url": str(source)}],
                tokenizer={"path": str(work / "tokenizer.json"), "vocab_size": 4096},
                cleaning={"min_chars": 1},
                workers=workers,
                shard_tokens=1 << 20,
            )
            result = prepare_dataset(cfg, StorageConfig())
            stages = result.seconds
            validation_s = sum(v for k, v in stages.items() if k.startswith("validate"))
            step_s = stages["total"] - validation_s
            tokens = sum(split["tokens"] for split in result.splits.values()) - result.cleaning["kept"]  # minus EOS
            shown = " ".join(f"{k}={v:.2f}" for k, v in stages.items())
            print(
                f"{workers:>7} {tokens / step_s:>11,.0f} {tokens / step_s / (bare_tokens / bare_s):>6.2f} "
                f"{100 * validation_s / step_s:>13.1f}%  {shown}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
