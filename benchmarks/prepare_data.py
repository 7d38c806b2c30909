"""Throughput of the data-preparation step against the bare tokenizer, measured side by side.

A jsonl corpus is made from the standard library's documentation (each document cleaned as the step
cleans it and kept once, then numbered copies, so that the step keeps every text and encodes exactly
the texts the bare tokenizer encodes); a BPE tokenizer is trained once and given to the step as a file,
so both sides encode with the same tokenizer, each loading it fresh (its word cache cold).

The bare side is `Tokenizer.encode_batch_fast` over the texts in memory, 512 a call as the step batches
them (one call over all 50,000 texts of the default corpus is slower per token: the batch's encodings are
all held at once), in a child process whose Rayon pool has N threads (RAYON_NUM_THREADS=N): the
tokenizer's own parallelism. The step with N workers encodes on N threads (tasks/prepare/encoding.py)
while its calling thread reads, cleans and writes: with one worker that work takes a second core where
one is free, and where none is (a loaded machine) the ratio falls to what the step's CPU time allows.
Each round runs the two sides back to back for every worker count; a ratio is taken within each round
and the median over --repeats rounds counts (the machine is shared: load shifts between rounds).
Printed, each with its goal:
- the whole step (read, clean, split, tokenize, shard, index, write; validation excluded) in tokens/s
  against the bare tokenizer at one thread: goal >= 0.85 with one worker;
- the step with N workers against the step with one: goal >= 1.00 (never slower), beside what the
  tokenizer's own pool gains from N threads (the scaling there is to keep);
- the time the Great Expectations suites add (the document suite, the dataset suite, the reports and
  Data Docs): goal <= 10% of the step at >= 6 M tokens;
- their fixed cost, measured on a tiny corpus (200 documents) and extrapolated to zero tokens from the
  tiny and the full corpus: goal <= 0.5 s. Importing Great Expectations (once per process) is printed
  apart and counted in neither;
- the cost of near-duplicate removal (cleaning.near_dup at its defaults) in seconds per million tokens: the
  cleaning alone (clean_documents over texts in memory) and the whole step at one worker (validation
  excluded), each with the rule off and on, back to back in each round, over one copy of the documentation
  (its texts are distinct; the numbered copies would be near-duplicates of one another). No goal: figures
  to weigh the rule by.

With --read, only the dataset reader is timed instead, against Megatron-Core's `IndexedDataset` on one
generated dataset (--read-tokens of random ids in Megatron shards of ours): every fixed-length sample of the
split (seq_len + 1 tokens) in one random order, read by `TokenDataset.sample` (copied to int64) and by
`TokenDataset.batch` (8 samples stacked into an int64 tensor), and the same windows read by Megatron's
`IndexedDataset.get(document, offset, length)`, handed each window's shard, document and offset ready-made
and copied or stacked the same way. Each round runs both sides back to back; printed are tokens/s of each and
the ratio ours / Megatron's: goal >= 0.8.

Usage: python benchmarks/prepare_data.py [--copies 24] [--workers 1 2] [--repeats 3]
       python benchmarks/prepare_data.py --read [--read-tokens 8000000] [--read-seq-len 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch

from tasks.prepare.clean import CleaningStats, clean_documents, clean_text
from tasks.prepare.config import CleaningConfig, NearDupConfig, PrepareConfig, TokenizerConfig
from tasks.prepare.corpus import stdlib_documents
from tasks.prepare.pipeline import PrepareResult, prepare_dataset
from tasks.prepare.sources import RawDocument
from tasks.prepare.tokenizer import train_bpe
from training.storage import StorageConfig

GOAL_ONE_WORKER = 0.85
GOAL_MORE_WORKERS = 1.00
GOAL_VALIDATION_SHARE = 0.10
GOAL_VALIDATION_FIXED_S = 0.5
GOAL_READ = 0.8
READ_VOCAB = 50_257
READ_BATCH = 8
VALIDATION_MIN_TOKENS = 6_000_000
TINY_DOCUMENTS = 200
BATCH_DOCUMENTS = 512
"""Texts per encode call, on both sides (the step's default batch_documents)."""


def _bare(corpus: Path, tokenizer: Path, batch: int) -> None:
    """Child process: time encode_batch_fast over every text of the corpus, `batch` texts a call (as the step
    batches them); print tokens and seconds as JSON."""
    from tokenizers import Tokenizer

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    hf = Tokenizer.from_file(str(tokenizer))
    tokens, seconds = 0, 0.0
    for start in range(0, len(texts), batch):
        began = time.perf_counter()
        encoded = hf.encode_batch_fast(texts[start : start + batch], add_special_tokens=False)
        seconds += time.perf_counter() - began
        tokens += sum(len(e) for e in encoded)
    print(json.dumps({"tokens": tokens, "seconds": seconds}))


def _bare_in_child(corpus: Path, tokenizer: Path, threads: int) -> tuple[int, float]:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}
    done = subprocess.run(
        [sys.executable, __file__, "--bare", str(corpus), str(tokenizer), str(BATCH_DOCUMENTS)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["tokens"], out["seconds"]


def _corpus_texts(copies: int) -> list[str]:
    """Numbered copies of the documentation, each text already as the step's cleaning leaves it, none twice."""
    cleaning = CleaningConfig(min_chars=1)
    docs = list(dict.fromkeys(clean_text(d, cleaning) for d in stdlib_documents(1_000_000)))
    return [clean_text(f"{doc}\n[copy {c}]", cleaning) for c in range(copies) for doc in docs if doc]


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def _step(
    work: Path,
    source: Path,
    tokenizer: Path,
    workers: int,
    run: str,
    near_dup: NearDupConfig | None = None,
    validate: bool = True,
) -> PrepareResult:
    cfg = PrepareConfig(
        output_url=str(work / f"out-{run}"),
        sources=[{"url": str(source)}],
        tokenizer={"path": str(tokenizer), "vocab_size": 4096},
        cleaning=CleaningConfig(min_chars=1, near_dup=near_dup),
        workers=workers,
        batch_documents=BATCH_DOCUMENTS,
        shard_tokens=1 << 20,
    )
    return prepare_dataset(cfg, StorageConfig(), validate=validate)


@dataclass
class Pair:
    """One round for one worker count: the bare tokenizer, then the step right after it (seconds)."""

    bare_s: float
    step_s: float
    """The step without its validation."""
    validation_s: float


def _cleaning_s(texts: list[str], cfg: CleaningConfig) -> tuple[float, CleaningStats]:
    """Seconds clean_documents takes over `texts` (already in memory), and its counts."""
    docs = [RawDocument(text, False, "bench") for text in texts]
    stats = CleaningStats()
    gc.collect()  # each side starts without the garbage of the one before
    began = time.perf_counter()
    for _ in clean_documents(docs, cfg, stats):
        pass
    return time.perf_counter() - began, stats


def _near_dup_cost(work: Path, texts: list[str], tokenizer: Path, repeats: int) -> None:
    """Time the cleaning alone, and the step at one worker, with near-duplicate removal off and on over `texts`;
    print both per million tokens."""
    source = work / "one-copy.jsonl"
    _write_jsonl(source, texts)
    near_dup = NearDupConfig()
    off_cfg, on_cfg = CleaningConfig(min_chars=1), CleaningConfig(min_chars=1, near_dup=near_dup)
    _cleaning_s(texts[:10], on_cfg)  # imports datasketch (once per process), not counted
    times: dict[str, list[float]] = {"cleaning off": [], "cleaning on": [], "step off": [], "step on": []}
    tokens = 0
    for repeat in range(repeats):
        times["cleaning off"].append(_cleaning_s(texts, off_cfg)[0])
        seconds, stats = _cleaning_s(texts, on_cfg)
        times["cleaning on"].append(seconds)
        for rule, cleaning in (("off", None), ("on", near_dup)):
            gc.collect()
            result = _step(work, source, tokenizer, 1, f"near-dup-{rule}-{repeat}", cleaning, validate=False)
            times[f"step {rule}"].append(result.seconds["total"])
            if cleaning is None:  # every text kept: the corpus's tokens
                tokens = sum(s["tokens"] for s in result.splits.values()) - result.cleaning["kept"]  # less the EOSs
    mtok = tokens / 1e6
    print(
        f"near-duplicate removal (threshold {near_dup.threshold}, {near_dup.shingle_words}-word shingles, "
        f"{near_dup.num_perm} permutations) over one copy: {len(texts):,} documents, "
        f"{tokens:,} tokens; {stats.removed['near_duplicate']:,} near-duplicates found"
    )
    print(f"{'':<16}  {'off s/M tok':>11}  {'on s/M tok':>10}  {'added':>6}  {'on/off':>6}  rounds on/off")
    for label, what in (("cleaning", "cleaning"), ("step, 1 worker", "step")):
        off, on = times[f"{what} off"], times[f"{what} on"]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        off_s, on_s = median(off) / mtok, median(on) / mtok
        print(
            f"{label:<16}  {off_s:>11.3f}  {on_s:>10.3f}  {on_s - off_s:>6.3f}  {median(ratios):>6.2f}  "
            + " ".join(f"{r:.2f}" for r in ratios)
        )
    added_us = (median(times["cleaning on"]) - median(times["cleaning off"])) / len(texts) * 1e6
    print(f"added by the rule per document read: {added_us:.0f} us ({tokens / len(texts):.0f} tokens per document)")


def _validation_s(result: PrepareResult) -> float:
    return sum(v for k, v in result.seconds.items() if k.startswith("validate"))


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _read_windows(data: Any, order: np.ndarray, batch: int) -> float:
    """Seconds our TokenDataset takes for every sample of `order`: one int64 copy a sample, or `batch` samples
    stacked into an int64 tensor (TokenDataset.batch, what the trainer calls)."""
    began = time.perf_counter()
    if batch == 1:
        for j in order:
            data.sample(int(j)).astype(np.int64)
    else:
        for start in range(0, order.size, batch):
            data.batch(order[start : start + batch])
    return time.perf_counter() - began


def _megatron_windows(shards: list[Any], where: np.ndarray, length: int, batch: int) -> float:
    """Seconds Megatron-Core's IndexedDataset takes for the same windows (shard, document, offset in it), each
    read by `get(document, offset, length)`, then copied or stacked exactly as on our side."""
    began = time.perf_counter()
    if batch == 1:
        for shard, doc, offset in where.tolist():
            shards[shard].get(doc, offset, length).astype(np.int64)
    else:
        for start in range(0, len(where), batch):
            rows = [shards[s].get(d, o, length) for s, d, o in where[start : start + batch].tolist()]
            torch.from_numpy(np.stack(rows).astype(np.int64))
    return time.perf_counter() - began


def _read_throughput(tokens: int, seq_len: int, repeats: int) -> None:
    """Our reader against Megatron-Core's on one generated dataset: the same fixed-length windows (a sample of
    seq_len + 1 tokens) over the whole split in one random order, read by each side alternately in each round;
    print tokens/s of each and the ratio ours / Megatron's with its goal."""
    os.environ.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")  # see test_megatron_interop.py `_indexed`
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from training.dataset import DatasetWriter, TokenDataset, TokenizerInfo

    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-read-"))
    try:
        rng = np.random.default_rng(0)
        url = str(work / "dataset")
        with DatasetWriter(url, READ_VOCAB, TokenizerInfo(kind="unknown"), READ_VOCAB - 1,
                           shard_tokens=max(1024, tokens // 4)) as writer:  # fmt: skip
            written = 0
            while written < tokens:
                docs = [rng.integers(0, READ_VOCAB - 1, size=int(n)) for n in rng.integers(50, 4000, size=256)]
                writer.add_documents("train", docs)
                written += sum(d.size + 1 for d in docs)
        data = TokenDataset(url, "train", seq_len, cache_dir=work / "cache")  # first-use checks: not timed
        infos = data.manifest.splits["train"].shards
        shards = [IndexedDataset(str(work / "dataset" / s.prefix)) for s in infos]
        order = rng.permutation(len(data))
        # Megatron's side is handed each window's (shard, document, offset) ready-made: only the reads are timed.
        first = np.concatenate(([0], np.cumsum([(s.n_tokens - 1) // seq_len for s in infos])))
        shard_of = np.searchsorted(first, order, side="right") - 1
        start = (order - first[shard_of]) * seq_len
        where = np.empty((order.size, 3), dtype=np.int64)
        where[:, 0] = shard_of
        for s, ds in enumerate(shards):
            mine = shard_of == s
            offsets = np.concatenate(([0], np.cumsum(ds.sequence_lengths, dtype=np.int64)))
            where[mine, 1] = np.searchsorted(offsets, start[mine], side="right") - 1
            where[mine, 2] = start[mine] - offsets[where[mine, 1]]
        for k in range(0, order.size, max(1, order.size // 50)):  # the two sides read the same tokens
            s, d, o = where[k].tolist()
            assert np.array_equal(data.sample(int(order[k])), shards[s].get(d, o, seq_len + 1)), k
        read = order.size * seq_len
        print(
            f"read throughput: {data.manifest.splits['train'].n_tokens:,} tokens ({data.manifest.dtype}) in "
            f"{len(infos)} shards, {order.size:,} samples of {seq_len} + 1 tokens in one random order, each side "
            f"reading every sample per round; the median over {repeats} rounds of the two sides back to back"
        )
        print(
            f"{'read':<28}  {'ours tok/s':>14}  {'Megatron tok/s':>14}  {'ratio':>6}  {'goal':<7} {'verdict':<8} rounds"
        )
        for batch in (1, READ_BATCH):
            _read_windows(data, order, batch)  # a round untimed: both sides' pages and code warm
            _megatron_windows(shards, where, seq_len + 1, batch)
            ours, theirs = [], []
            for _ in range(repeats):
                ours.append(_read_windows(data, order, batch))
                theirs.append(_megatron_windows(shards, where, seq_len + 1, batch))
            ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
            label = "sample, int64 copy" if batch == 1 else f"batch of {batch}, int64 tensor"
            ok = median(ratios) >= GOAL_READ
            print(
                f"{label:<28}  {read / median(ours):>14,.0f}  {read / median(theirs):>14,.0f}  "
                f"{median(ratios):>6.2f}  >= {GOAL_READ:<4} {_verdict(ok):<8} " + " ".join(f"{r:.2f}" for r in ratios)
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    """Build the corpus, then time both sides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=24, help="numbered copies of the ~1 MB documentation corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time (1 first)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both sides; the median counts")
    parser.add_argument("--read", action="store_true", help="time only the dataset reader against Megatron-Core's")
    parser.add_argument("--read-tokens", type=int, default=8_000_000, help="--read: tokens of the generated dataset")
    parser.add_argument("--read-seq-len", type=int, default=1024, help="--read: tokens per sample (seq_len)")
    parser.add_argument("--bare", nargs=3, metavar=("CORPUS", "TOKENIZER", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        _bare(Path(args.bare[0]), Path(args.bare[1]), int(args.bare[2]))
        return
    if args.read:
        _read_throughput(args.read_tokens, args.read_seq_len, args.repeats)
        return
    workers = sorted(set(args.workers) | {1})
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-prepare-"))
    try:
        texts = _corpus_texts(args.copies)
        source, tiny = work / "corpus.jsonl", work / "tiny.jsonl"
        _write_jsonl(source, texts)
        _write_jsonl(tiny, texts[:TINY_DOCUMENTS])
        tokenizer = work / "tokenizer.json"
        one_copy = texts[: len(texts) // args.copies]
        tokenizer.write_text(train_bpe(iter(one_copy), TokenizerConfig(vocab_size=4096)).json_text)
        started = time.perf_counter()
        from validation.data import SuiteRunner

        SuiteRunner().close()
        import_s = time.perf_counter() - started

        runs: dict[int, list[Pair]] = {n: [] for n in workers}
        result = None
        for repeat in range(args.repeats):
            for n in workers:
                bare_tokens, bare_s = _bare_in_child(source, tokenizer, n)
                result = _step(work, source, tokenizer, n, f"{n}-{repeat}")
                validation_s = _validation_s(result)
                runs[n].append(Pair(bare_s, result.seconds["total"] - validation_s, validation_s))
                kept = result.cleaning["kept"]
                step_tokens = sum(s["tokens"] for s in result.splits.values()) - kept  # less one EOS per document
                assert step_tokens == bare_tokens and kept == len(texts), "the two sides encoded other texts"
        tiny_result = _step(work, tiny, tokenizer, 1, "tiny")
        tiny_tokens = sum(s["tokens"] for s in tiny_result.splits.values()) - tiny_result.cleaning["kept"]
        tiny_s = _validation_s(tiny_result)

        size = source.stat().st_size / 1e6
        print(f"corpus: {len(texts):,} documents, {size:.1f} MB, {step_tokens:,} tokens (the step keeps every text)")
        print(
            f"cores: {os.cpu_count()}; importing Great Expectations: {import_s:.1f} s (not counted); each figure is "
            f"the median over {args.repeats} rounds of the two sides run back to back (then each round's value)"
        )
        print(f"{'workers':>7}  {'bare tok/s':>11}  {'step tok/s':>11}")
        for n in workers:
            bare_rate = median(step_tokens / p.bare_s for p in runs[n])
            print(f"{n:>7}  {bare_rate:>11,.0f}  {median(step_tokens / p.step_s for p in runs[n]):>11,.0f}")
        print(f"{'workers':>7}  {'ratio':<36} {'median':>6}  {'goal':<8} {'verdict':<8} rounds")
        verdicts = []
        for n in workers:
            rows: list[tuple[str, list[float], str, bool | None]] = []
            one_thread = [b.bare_s / p.step_s for b, p in zip(runs[1], runs[n], strict=True)]
            goal_one = n == 1
            rows.append(("step / bare tokenizer at 1 thread", one_thread, f">= {GOAL_ONE_WORKER}" if goal_one else "",
                         median(one_thread) >= GOAL_ONE_WORKER if goal_one else None))  # fmt: skip
            if n > 1:
                more = [o.step_s / p.step_s for o, p in zip(runs[1], runs[n], strict=True)]
                rows.append(("step / step at 1 worker", more, f">= {GOAL_MORE_WORKERS:.2f}",
                             median(more) >= GOAL_MORE_WORKERS))  # fmt: skip
                own = [b.bare_s / p.bare_s for b, p in zip(runs[1], runs[n], strict=True)]
                rows.append((f"bare at {n} threads / bare at 1 thread", own, "", None))
                rows.append((f"step / bare tokenizer at {n} threads", [p.bare_s / p.step_s for p in runs[n]], "", None))
            share = [p.validation_s / p.step_s for p in runs[n]]
            judged = step_tokens >= VALIDATION_MIN_TOKENS
            rows.append(("validation / step", share, f"<= {GOAL_VALIDATION_SHARE:.2f}",
                         median(share) <= GOAL_VALIDATION_SHARE if judged else None))  # fmt: skip
            for label, values, goal, ok in rows:
                verdict = "" if ok is None else _verdict(ok)
                shown = " ".join(f"{v:.2f}" for v in values)
                print(f"{n:>7}  {label:<36} {median(values):>6.2f}  {goal:<8} {verdict:<8} {shown}")
                if ok is not None:
                    verdicts.append(f"{n} worker(s): {label} {median(values):.2f} (goal {goal}): {verdict}")
        full_s = median(p.validation_s for p in runs[1])
        slope = (full_s - tiny_s) / max(1, step_tokens - tiny_tokens)
        intercept = full_s - slope * step_tokens
        print(
            f"validation: {tiny_s:.2f} s on {tiny_tokens:,} tokens (tiny corpus), {full_s:.2f} s on "
            f"{step_tokens:,}; fixed cost extrapolated to zero tokens {intercept:.2f} s (goal <= "
            f"{GOAL_VALIDATION_FIXED_S} s), {slope * 1e6:.3f} s per M tokens"
        )
        fixed = max(tiny_s, intercept)
        verdicts.append(
            f"validation fixed cost <= {GOAL_VALIDATION_FIXED_S} s: {fixed:.2f} s, "
            f"{_verdict(fixed <= GOAL_VALIDATION_FIXED_S)}"
        )
        assert result is not None
        stages = " ".join(f"{k}={v:.2f}" for k, v in result.seconds.items())
        print(f"stages of the last {workers[-1]}-worker run (s): {stages}")
        _near_dup_cost(work, one_copy, tokenizer, args.repeats)
        if step_tokens < VALIDATION_MIN_TOKENS:
            verdicts.append(f"validation share not judged below {VALIDATION_MIN_TOKENS:,} tokens (raise --copies)")
        for line in verdicts:
            print(f"- {line}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
