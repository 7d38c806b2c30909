"""Forged LEASE.json records: anyone who can write the storage can write one, so a record is validated (finite,
bounded numbers, printable names) and one that fails is an unreadable record, taken over with a warning; it never
crashes the rank, and its text never reaches the log unescaped."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from training.lease import LEASE_FILE, Lease, LeaseHeld
from training.untrusted import escape_untrusted

INJECTED = "\n2030-01-01 00:00:00 INFO training.train: step 100 loss 0.01"


def _live_record(**changes: Any) -> dict[str, Any]:
    """A lease of a live job on another machine, valid for another minute."""
    now = time.time()
    record = {
        "url": "/runs/x", "job_id": "other-job", "host": "node7", "pid": 424242, "pid_start_time": "1",
        "boot_id": "another-boot", "pid_namespace": None, "token": "t" * 32,
        "started_unix_s": now - 100, "renewed_unix_s": now - 10, "expires_unix_s": now + 60,
    }  # fmt: skip
    return record | changes


FORGED: dict[str, tuple[str, str]] = {
    "expires-infinity": (json.dumps(_live_record(expires_unix_s=float("inf"))), "expires_unix_s"),
    "expires-nan": (json.dumps(_live_record(expires_unix_s=float("nan"))), "expires_unix_s"),
    "expires-1e20": (json.dumps(_live_record(expires_unix_s=1e20)), "expires_unix_s"),
    "expires-string": (json.dumps(_live_record(expires_unix_s="tomorrow")), "expires_unix_s"),
    "started-negative": (json.dumps(_live_record(started_unix_s=-1e12)), "started_unix_s"),
    "pid-huge": (json.dumps(_live_record(pid=10**30)), "pid"),
    "pid-bool": (json.dumps(_live_record(pid=True)), "pid"),
    "host-newline": (json.dumps(_live_record(host="node7" + INJECTED)), "host"),
    "host-escape": (json.dumps(_live_record(host="\x1b[2J\x1b[31mnode7")), "host"),
    "host-huge": (json.dumps(_live_record(host="n" * 100_000)), "host"),
    "job-newline": (json.dumps(_live_record(job_id="job" + INJECTED)), "job_id"),
    "unknown-field-escape": (json.dumps(_live_record(**{"x\x1b[2J\nINFO": 1})), "x\\x1b[2J\\nINFO"),
    "missing-field": (json.dumps({k: v for k, v in _live_record().items() if k != "token"}), "token"),
    "a-list": ("[1, 2]", "a JSON list"),
    "digits": ('{"pid": ' + "9" * 5000 + "}", "not JSON (ValueError)"),
    "nesting": ("[" * 100_000 + "]" * 100_000, "not JSON (RecursionError)"),
}


@pytest.mark.parametrize("forged", list(FORGED))
def test_a_forged_lease_record_is_taken_over_as_unreadable_and_logged_escaped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, forged: str
) -> None:
    text, named = FORGED[forged]
    (tmp_path / LEASE_FILE).write_text(text)
    with caplog.at_level(logging.INFO, logger="training.lease"):
        with Lease(str(tmp_path), label="run.output_url", job_id="mine") as lease:
            assert lease.held
    messages = [record.getMessage() for record in caplog.records]
    takeover = [m for m in messages if "took over a stale lease held by an unreadable record" in m]
    assert len(takeover) == 1, messages
    assert "its record is unreadable (not a lease record: " in takeover[0] and named in takeover[0]
    assert all("\n" not in m and "\x1b" not in m for m in messages), messages


def test_a_valid_record_of_a_live_holder_is_still_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / LEASE_FILE).write_text(json.dumps(_live_record(host="node-é7", job_id="train 42")))
    with pytest.raises(LeaseHeld) as refused:
        Lease(str(tmp_path), label="run.output_url", job_id="mine").acquire()
    assert "held by pid 424242 on host node-é7 (job train 42) since " in str(refused.value)


def test_escape_untrusted_writes_control_characters_as_repr_does_and_cuts_long_text() -> None:
    assert escape_untrusted("a\nb\x1b[2J\u202ec\\d é") == "a\\nb\\x1b[2J\\u202ec\\d é"
    assert escape_untrusted("x" * 1000, limit=10) == "xxxxxxxxxx... (1000 characters)"
    assert escape_untrusted("x" * 1000, limit=None) == "x" * 1000
