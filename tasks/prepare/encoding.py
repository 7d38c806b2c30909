"""Text to token ids: batches encoded on `workers` threads while the calling thread reads and writes.

Which parallelism, and why: threads of this process, each running the tokenizer single-threaded on whole
batches. HF tokenizers releases the GIL while it encodes, so N threads encode N batches at once on N cores,
with nothing to start and nothing to pickle; the spawned worker processes used before took 0.6-0.8 s
to start (importing numpy and tokenizers) and pickled every batch's texts out and ids back, which made
two workers slower than one. The library's own Rayon pool (encode_batch with TOKENIZERS_PARALLELISM on)
was the other candidate, but its size is fixed the first time anything in the process uses it
(RAYON_NUM_THREADS is read once; BPE training or an earlier step may already have started it), so it
cannot honour `workers`: every encode call would take every core whatever the setting says. So while an
`Encoder` is open TOKENIZERS_PARALLELISM is "false" (the library reads it on every call) and the
parallelism is ours. The calling thread meanwhile reads, cleans and writes; it shares the GIL only with the
short conversion of each batch's ids to one array. `workers` None means one thread per core.
"""

from __future__ import annotations

import array
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

Key = TypeVar("Key")

PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
_serial_lock = threading.Lock()
_serial_users = 0
_saved_parallelism: str | None = None


@dataclass
class EncodedBatch:
    """The ids of a batch of texts: one flat array and each text's length (no EOS)."""

    ids: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)

    def documents(self) -> list[np.ndarray]:
        """One array (a view into `ids`) per text."""
        ends = np.cumsum(self.lengths)
        return [self.ids[begin:end] for begin, end in zip((ends - self.lengths).tolist(), ends.tolist(), strict=True)]


def encode_texts(hf_tokenizer: Any, texts: list[str], dtype: str) -> EncodedBatch:
    """Ids of each text (no EOS): its UTF-8 bytes when there is no tokenizer, else the BPE's."""
    if hf_tokenizer is None:
        raw = [t.encode("utf-8") for t in texts]
        ids = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(dtype)
        return EncodedBatch(ids, np.fromiter(map(len, raw), dtype=np.int64, count=len(raw)))
    encodings = hf_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    flat = array.array("I")  # u32, as the tokenizer's ids are: extending from each list is a C loop
    lengths = np.empty(len(encodings), dtype=np.int64)
    for number, encoding in enumerate(encodings):
        ids = encoding.ids
        flat.extend(ids)
        lengths[number] = len(ids)
    return EncodedBatch(np.frombuffer(flat, dtype=np.uint32).astype(dtype, copy=False), lengths)


def encode_threads(workers: int | None) -> int:
    """Threads to encode on: `workers`, or one per CPU core this process may use."""
    if workers is not None:
        return workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _serial_tokenizer_calls(enter: bool) -> None:
    """TOKENIZERS_PARALLELISM=false while any Encoder is open; the value before the first one comes back after
    the last (steps may run side by side in one process)."""
    global _serial_users, _saved_parallelism
    with _serial_lock:
        if enter:
            if _serial_users == 0:
                _saved_parallelism = os.environ.get(PARALLELISM_ENV)
                os.environ[PARALLELISM_ENV] = "false"
            _serial_users += 1
            return
        _serial_users -= 1
        if _serial_users == 0:
            if _saved_parallelism is None:
                os.environ.pop(PARALLELISM_ENV, None)
            else:
                os.environ[PARALLELISM_ENV] = _saved_parallelism


class Encoder:
    """Encodes batches on `workers` threads and hands them back in the order they were given.

    Use as a context manager: the threads start on entry and are joined on exit.
    """

    def __init__(self, hf_tokenizer: Any, dtype: str, workers: int) -> None:
        self.hf, self.dtype, self.workers = hf_tokenizer, dtype, workers
        self.ahead = 2 * workers
        """Batches in flight at most: every thread busy, and the next batch ready when one finishes."""
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> Encoder:
        _serial_tokenizer_calls(True)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tdeploy-encode")
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._pool is not None
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
        finally:
            self._pool = None
            _serial_tokenizer_calls(False)

    def encode(self, batches: Iterable[tuple[Key, list[str]]]) -> Iterator[tuple[Key, EncodedBatch]]:
        """(key, ids) for each (key, texts), in order; the next batches are read while earlier ones encode."""
        assert self._pool is not None, "use the Encoder as a context manager"
        pending: deque[tuple[Key, Future[EncodedBatch]]] = deque()
        for key, texts in batches:
            pending.append((key, self._pool.submit(encode_texts, self.hf, texts, self.dtype)))
            while pending and (len(pending) > self.ahead or pending[0][1].done()):
                done_key, future = pending.popleft()
                yield done_key, future.result()
        while pending:
            done_key, future = pending.popleft()
            yield done_key, future.result()
