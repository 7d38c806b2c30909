"""Run ids: the names of acceptance run workspaces, which are also the ids of the ledger entries they record.

Below both tasks/acceptance and tasks/ledger (it imports neither), so that each names runs the same way.
"""

from __future__ import annotations

import re
import secrets
import threading
from datetime import UTC, datetime, timedelta

RUN_ID = re.compile(r"^\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{6}$")
"""A run id: a UTC time to the microsecond and 6 random hex digits."""
_last_time = datetime.min.replace(tzinfo=UTC)
_id_lock = threading.Lock()


def new_run_id(now: datetime | None = None) -> str:
    """A unique run id that sorts by time: `20260102T030405.123456Z-1a2b3c` (later ids of a process sort later)."""
    global _last_time
    with _id_lock:
        stamp = max(now or datetime.now(UTC), _last_time + timedelta(microseconds=1))
        _last_time = stamp
    return f"{stamp.strftime('%Y%m%dT%H%M%S.%f')}Z-{secrets.token_hex(3)}"
