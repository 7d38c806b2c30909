"""Node failure memory of a deployment: which hosts failed when, and which are quarantined.

Where: `<ledger>/nodes/` (tasks/paths.py `DeploymentPaths.node_memory_url`), one small JSON file per event, named by
a run id (tasks/run_id.py: events sort by time) and created once, never rewritten, so that two controllers that
record at once never lose each other's events, on local disks and object stores alike:

    failure     the restart policy blamed the host for a job's failure (its cause and the job)
    quarantine  an operator quarantined the host (`tdeploy nodes quarantine HOST --spec SPEC`)
    clear       an operator cleared the host (`tdeploy nodes clear HOST --spec SPEC`): earlier events stop counting

A host is quarantined from the failure that made it fail `recovery.quarantine_after_failures` times within
`recovery.quarantine_window_s` (or from an operator's quarantine) until the next clear; quarantined hosts are left
out of every later job of the deployment (tasks/launch/step.py). The files are read as untrusted, as the ledger's
are: with TDEPLOY_CHECKPOINT_KEY set each one is signed and a file whose signature is missing or wrong is skipped
with a warning naming it (a planted `clear` must not return a bad host to service).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.errors import UserError
from tasks.hosts import HOST_NAME
from tasks.recovery.config import RecoveryConfig
from tasks.run_id import RUN_ID, new_run_id
from training.checkpoint import KEY_ENV, SIGNATURE_FIELD, checkpoint_key, sign_commit
from training.storage import ControlFileError, StorageConfig, filesystem, join, read_control_file, write_bytes_atomic

log = logging.getLogger(__name__)

EventKind = Literal["failure", "quarantine", "clear"]


class NodeEvent(BaseModel):
    """One file of the node memory."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: EventKind = Field(description="failure (the policy blamed the host), quarantine or clear (an operator).")
    host: str = Field(pattern=HOST_NAME, description="The host's name as the job's ranks recorded it.")
    time_unix_s: float = Field(ge=0, description="When it happened.")
    reason: str = Field(default="", max_length=2000, description="The failure's cause, or the operator's reason.")
    job: str | None = Field(default=None, max_length=500, description="The job that failed on it (failure events).")


@dataclass(frozen=True)
class HostState:
    """A host as the node memory sees it now: its failures since the last clear, and whether it is quarantined."""

    host: str
    failures: list[NodeEvent] = field(default_factory=list)
    quarantined_since_unix_s: float | None = None
    reason: str = ""

    @property
    def quarantined(self) -> bool:
        """Left out of the deployment's jobs until an operator clears it."""
        return self.quarantined_since_unix_s is not None

    def describe(self) -> str:
        """One line for people."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.quarantined_since_unix_s or 0))
        state = f"quarantined since {since} UTC: {self.reason}" if self.quarantined else "in service"
        return f"{self.host}: {state} ({len(self.failures)} failure(s) since the last clear)"


def check_host(host: str) -> str:
    """`host` when it is a host name (letters, digits, . _ -, starting with a letter or digit); UserError otherwise."""
    if not isinstance(host, str) or re.fullmatch(HOST_NAME, host) is None:
        raise UserError(
            f"host {host!r} is not a host name", "use the name the job's ranks ran on (letters, digits, . _ -)"
        )
    return host


class NodeMemory:
    """The node memory folder at `url` (see the module docstring), judged by `config`."""

    def __init__(self, url: str, config: RecoveryConfig, storage: StorageConfig | None = None) -> None:
        self.url, self.config = url, config
        self.fs, self.root = filesystem(url, storage)
        self.key = checkpoint_key()

    # ---- writing ----------------------------------------------------------------------------

    def _write(self, event: NodeEvent) -> NodeEvent:
        data = json.loads(event.model_dump_json())
        if self.key is not None:
            data = sign_commit(data, self.key)
        self.fs.makedirs(self.root, exist_ok=True)
        write_bytes_atomic(self.fs, join(self.root, f"{new_run_id()}.json"), json.dumps(data, indent=2).encode())
        return event

    def record_failure(self, host: str, reason: str, job: str | None = None, now: float | None = None) -> HostState:
        """Remember that `host` failed (the policy's cause in `reason`); its state after it (quarantined or not)."""
        self._write(NodeEvent(kind="failure", host=check_host(host), time_unix_s=time.time() if now is None else now,
                              reason=reason[:2000], job=job))  # fmt: skip
        return self.state(host)

    def quarantine(self, host: str, reason: str = "", now: float | None = None) -> HostState:
        """An operator quarantines `host`."""
        self._write(NodeEvent(kind="quarantine", host=check_host(host), time_unix_s=time.time() if now is None else now,
                              reason=reason[:2000] or "quarantined by an operator"))  # fmt: skip
        return self.state(host)

    def clear(self, host: str, reason: str = "", now: float | None = None) -> HostState:
        """An operator clears `host`: it is back in service and its earlier failures stop counting."""
        self._write(NodeEvent(kind="clear", host=check_host(host), time_unix_s=time.time() if now is None else now,
                              reason=reason[:2000] or "cleared by an operator"))  # fmt: skip
        return self.state(host)

    # ---- reading ----------------------------------------------------------------------------

    def events(self) -> list[NodeEvent]:
        """Every readable event, oldest first; a file that is not an event (or not signed under the key) is skipped
        with a warning naming it."""
        if not self.fs.exists(self.root):
            return []
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
        events = []
        for name in names:
            if not name.endswith(".json") or not RUN_ID.match(name.removesuffix(".json")):
                continue
            path = join(self.root, name)
            problem, event = self._read(path)
            if problem is not None:
                log.warning("node memory file %s skipped: %s; move it out of %s", path, problem, self.url)
                continue
            events.append(event)
        return sorted(events, key=lambda e: e.time_unix_s)

    def _read(self, path: str) -> tuple[str | None, NodeEvent | None]:
        try:
            data = json.loads(read_control_file(self.fs, path))
        except (ControlFileError, OSError, ValueError) as err:
            return f"cannot be read ({type(err).__name__}: {err})", None
        if not isinstance(data, dict):
            return "not a JSON object", None
        signature = data.pop(SIGNATURE_FIELD, None)
        if self.key is not None:
            expected = sign_commit(data, self.key)[SIGNATURE_FIELD]
            if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
                return f"not signed with {KEY_ENV} (written by hand, or altered)", None
        try:
            return None, NodeEvent.model_validate(data)
        except ValidationError as err:
            return f"not a node event ({err.errors()[0]['msg']})", None

    def states(self, now: float | None = None) -> dict[str, HostState]:
        """Every host the memory knows, by name."""
        by_host: dict[str, list[NodeEvent]] = {}
        for event in self.events():
            by_host.setdefault(event.host, []).append(event)
        return {host: self._state(host, events) for host, events in sorted(by_host.items())}

    def state(self, host: str) -> HostState:
        """`host` as the memory sees it now."""
        return self._state(host, [e for e in self.events() if e.host == host])

    def _state(self, host: str, events: Sequence[NodeEvent]) -> HostState:
        failures: list[NodeEvent] = []
        since: float | None = None
        reason = ""
        window, limit = self.config.quarantine_window_s, self.config.quarantine_after_failures
        for event in events:
            if event.kind == "clear":
                failures, since, reason = [], None, ""
            elif event.kind == "quarantine" and since is None:
                since, reason = event.time_unix_s, event.reason
            elif event.kind == "failure":
                failures.append(event)
                recent = [f for f in failures if f.time_unix_s >= event.time_unix_s - window]
                if since is None and len(recent) >= limit:
                    since = event.time_unix_s
                    reason = (f"failed {len(recent)} times within {window:g}s "
                              f"(recovery.quarantine_after_failures={limit}): "
                              + "; ".join(f.reason for f in recent[-limit:]))  # fmt: skip
        return HostState(host, failures, since, reason)

    def quarantined(self) -> list[str]:
        """The quarantined hosts, by name."""
        return [host for host, state in self.states().items() if state.quarantined]
