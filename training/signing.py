"""Signed commit records: the HMAC key from TDEPLOY_CHECKPOINT_KEY, the signature and when to believe one.

A checkpoint's COMMIT.json (training/checkpoint/) and the ledger's records (tasks/ledger/) are signed the same
way; the table of what a loader believes is in training/checkpoint/trust.py. Plain Python (hmac, json), so that
the ledger's readers name it without importing torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "TDEPLOY_CHECKPOINT_KEY"
SIGNATURE_FIELD = "hmac_sha256"
MIN_KEY_CHARS = 16


class CheckpointKeyError(RuntimeError):
    """The checkpoint signing key is missing for a signed checkpoint, or too short to be a key."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem))


def checkpoint_key() -> bytes | None:
    """The HMAC key from TDEPLOY_CHECKPOINT_KEY (None when unset); a set but short key is an error."""
    raw = os.environ.get(KEY_ENV)
    if raw is None:
        return None
    if len(raw) < MIN_KEY_CHARS:
        raise CheckpointKeyError(
            KEY_ENV,
            f"is set but has {len(raw)} characters; use at least {MIN_KEY_CHARS} random ones "
            f"(e.g. `openssl rand -hex 32`), or unset it to save unsigned checkpoints",
        )
    return raw.encode()


def _canonical(record: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in record.items() if k != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_commit(record: dict[str, Any], key: bytes) -> dict[str, Any]:
    """`record` with its HMAC-SHA256 signature added."""
    return {**record, SIGNATURE_FIELD: hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()}


def untrusted_reason(record: dict[str, Any], key: bytes | None, where: str) -> str | None:
    """Why a commit record must not be believed under `key` (None: believe it); see training/checkpoint/trust.py."""
    signature = record.get(SIGNATURE_FIELD)
    if key is None:
        if signature is not None:
            raise CheckpointKeyError(
                where,
                f"its COMMIT.json is signed ({SIGNATURE_FIELD}) but {KEY_ENV} is not set; set {KEY_ENV} to the key "
                "the run saved it with (the task layer passes it from the Prefect Secret block), or move the "
                "checkpoint away to start without it",
            )
        return None
    if signature is None:
        return f"its COMMIT.json is not signed while {KEY_ENV} is set (saved without a key, or the signature removed)"
    expected = hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()
    if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
        return f"its COMMIT.json signature does not match {KEY_ENV} (saved with another key, or altered)"
    return None
