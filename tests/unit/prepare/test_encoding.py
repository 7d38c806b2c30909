"""`workers` is the number of threads of this process that encode at once, each running the tokenizer
single-threaded; the tokenizer's own thread pool is off only while they run."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tasks.errors import UserError
from tasks.prepare import encoding
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from training.storage import StorageConfig

PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"


def _config(tmp_path: Path, workers: int | None) -> PrepareConfig:
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " + "words " * (i % 30)}) + "\n" for i in range(200)))
    return PrepareConfig(
        output_url=str(tmp_path / "out"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        cleaning={"min_chars": 5},
        val_fraction=0.2,
        workers=workers,
        batch_documents=10,
        shard_tokens=1024,
    )


@pytest.mark.parametrize("setting", [1, 3, None])
def test_batches_are_encoded_by_workers_threads_at_once_with_the_tokenizers_pool_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: int | None
) -> None:
    monkeypatch.setenv(PARALLELISM_ENV, "true")
    workers = setting or len(os.sched_getaffinity(0))  # None: one per core
    calls: list[tuple[int, str, str | None]] = []
    at_once = min(workers, 8)  # the corpus has 20 batches: enough to see 8 encode at once
    first_round = threading.Barrier(at_once, timeout=30)  # passes only when that many batches encode at once
    real = encoding.encode_texts
    lock = threading.Lock()

    def recorded(hf: object, texts: list[str], dtype: str) -> encoding.EncodedBatch:
        with lock:
            calls.append((os.getpid(), threading.current_thread().name, os.environ.get(PARALLELISM_ENV)))
            number = len(calls)
        if number <= at_once:
            first_round.wait()
        return real(hf, texts, dtype)

    monkeypatch.setattr(encoding, "encode_texts", recorded)
    result = prepare_dataset(_config(tmp_path, setting), StorageConfig(), validate=False)
    assert len(calls) >= 200 // 10 and sum(s["docs"] for s in result.splits.values()) == 200
    assert {pid for pid, _, _ in calls} == {os.getpid()}
    threads = {name for _, name, _ in calls}
    assert at_once <= len(threads) <= workers and threading.current_thread().name not in threads
    assert {env for _, _, env in calls} == {"false"}
    assert os.environ[PARALLELISM_ENV] == "true"  # as it was before the step


def test_the_tokenizers_setting_is_restored_after_the_last_of_two_overlapping_encoders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PARALLELISM_ENV, raising=False)
    first, second = encoding.Encoder(None, "uint16", 1), encoding.Encoder(None, "uint16", 1)
    with first:
        with second:
            assert os.environ[PARALLELISM_ENV] == "false"
        assert os.environ[PARALLELISM_ENV] == "false"  # the first is still encoding
    assert PARALLELISM_ENV not in os.environ


def test_batches_come_back_in_the_order_given_with_each_documents_ids(tmp_path: Path) -> None:
    texts = [[f"text {b}.{i} " * (1 + (b * 7 + i) % 5) for i in range(1 + b % 4)] for b in range(30)]
    with encoding.Encoder(None, "uint16", 4) as encoder:
        out = list(encoder.encode((b, batch) for b, batch in enumerate(texts)))
    assert [key for key, _ in out] == list(range(30))
    for (_, encoded), batch in zip(out, texts, strict=True):
        assert [doc.tobytes() for doc in encoded.documents()] == [
            np.frombuffer(t.encode(), dtype=np.uint8).astype(np.uint16).tobytes() for t in batch
        ]


def test_bpe_ids_are_those_of_encoding_each_text_alone(tmp_path: Path) -> None:
    from tasks.prepare.config import TokenizerConfig
    from tasks.prepare.tokenizer import train_bpe

    texts = [f"the {i}th sentence of the corpus, \u00e9t\u00e9 {i * i}" for i in range(60)]
    tokenizer = train_bpe(iter(texts), TokenizerConfig(vocab_size=300, min_frequency=1))
    encoded = encoding.encode_texts(tokenizer._hf, texts + [""], "uint16")
    assert encoded.ids.dtype == np.uint16 and encoded.lengths[-1] == 0
    alone = [tokenizer._hf.encode(t, add_special_tokens=False).ids for t in texts] + [[]]
    assert [doc.tolist() for doc in encoded.documents()] == alone


def test_an_error_while_reading_stops_the_threads_restores_the_setting_and_removes_the_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PARALLELISM_ENV, raising=False)
    cfg = _config(tmp_path, 2)
    Path(cfg.sources[0].url).write_text(
        "".join(json.dumps({"text": f"document {i} with text enough for 40 bytes"}) + "\n" for i in range(100))
        + "not json\n"
    )
    written: list[int] = []
    with pytest.raises(UserError, match=r"corpus\.jsonl:101: not valid JSON"):
        prepare_dataset(cfg, StorageConfig(), lambda stage, done, total: written.append(done), validate=False)
    # over half the documents are train's, each 40+ tokens: train had a shard on disk before the error
    assert max(written) // 2 * 40 >= cfg.shard_tokens
    assert PARALLELISM_ENV not in os.environ
    assert not [t for t in threading.enumerate() if t.name.startswith("tdeploy-encode")]
    assert not Path(cfg.output_url).exists() or not list(Path(cfg.output_url).rglob("*"))
