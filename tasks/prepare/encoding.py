"""Text to id arrays, in this process or in spawned tokenizer workers.

Kept free of torch and the rest of the project so that a spawned worker starts
in a fraction of a second. Workers are spawned, not forked: forking a process
that already runs threads (Prefect, s3fs, the tokenizer's own pool) can leave a
child waiting forever on a lock some thread held at the fork.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_worker: tuple[Any, str] | None = None


def encode_texts(hf_tokenizer: Any, texts: list[str], dtype: str) -> list[np.ndarray]:
    """Ids of each text (no EOS): byte values when there is no tokenizer, else the BPE's."""
    if hf_tokenizer is None:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]
    return [np.asarray(e.ids, dtype=dtype) for e in hf_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def init_worker(json_text: str | None, dtype: str) -> None:
    """Pool initializer: load the tokenizer once per worker, single-threaded (the pool is the parallelism)."""
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    hf = None
    if json_text is not None:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_str(json_text)
    _worker = (hf, dtype)


def encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    """Pool task: encode one batch with this worker's tokenizer."""
    assert _worker is not None, "init_worker runs first"
    return encode_texts(_worker[0], texts, _worker[1])
