"""Flow runs whose supervising process died: found by their supervisor tag and marked Crashed.

`tdeploy run` tags its flow run (and so its task runs) with its own identity:
`tdeploy-supervisor:<host>:<pid>:<start time>:<boot id>`. Killed, even with SIGKILL, it
cannot report the end of its run; its local job stops with it (tasks/launch/local.py), and
the next `tdeploy run` finds the flow run still Running under a supervisor that is gone
and marks it, and its unfinished task runs, Crashed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Crashed

from training import process

log = logging.getLogger(__name__)

TAG_PREFIX = "tdeploy-supervisor:"
_UNFINISHED = [StateType.RUNNING, StateType.PENDING]
# What an interrupt leaves behind: Prefect marks the runs it was in the middle of Crashed.
_INTERRUPTED = [*_UNFINISHED, StateType.CRASHED, StateType.CANCELLING, StateType.SCHEDULED]


@dataclass(frozen=True)
class Supervisor:
    """The process that ran a flow run: host, pid, the pid's start time, and the boot it ran in."""

    host: str
    pid: int
    start_time: str
    boot_id: str

    @classmethod
    def current(cls) -> Supervisor:
        """This process."""
        me = process.machine()
        return cls(me.host, os.getpid(), process.start_time(os.getpid()) or "?", (me.boot_id or "?")[:8])

    def tag(self) -> str:
        """As a Prefect tag."""
        return f"{TAG_PREFIX}{self.host}:{self.pid}:{self.start_time}:{self.boot_id}"

    @classmethod
    def from_tags(cls, tags: list[str]) -> Supervisor | None:
        """The supervisor named in a run's tags, if any."""
        for tag in tags:
            if tag.startswith(TAG_PREFIX):
                host, pid, started, boot = tag[len(TAG_PREFIX) :].rsplit(":", 3)
                return cls(host, int(pid), started, boot)
        return None

    def gone(self) -> bool:
        """It ran on this host and no longer runs (a reboot ends every process); False for other hosts."""
        here = Supervisor.current()
        if self.host != here.host:
            return False
        return self.boot_id != here.boot_id or not process.alive(self.pid, self.start_time)

    def describe(self) -> str:
        """`pid P on host H`."""
        return f"pid {self.pid} on host {self.host}"


@dataclass
class CrashedRun:
    """A flow run marked Crashed because its supervisor was gone, with the task runs marked with it."""

    flow_run_id: UUID
    flow_run_name: str
    flow_name: str
    supervisor: Supervisor
    task_runs: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for people."""
        tasks = f" and its task run(s) {', '.join(self.task_runs)}" if self.task_runs else ""
        return (
            f"flow run {self.flow_run_name} ({self.flow_run_id}) of {self.flow_name}{tasks}: marked Crashed, "
            f"its supervisor {self.supervisor.describe()} is gone"
        )


def _message(supervisor: Supervisor) -> str:
    return f"its supervising process ({supervisor.describe()}) exited without reporting an end: it was killed"


def crash_orphaned_flow_runs(client: Any | None = None) -> list[CrashedRun]:
    """Mark Crashed every unfinished flow run whose tagged supervisor on this host is gone, and its unfinished tasks."""
    if client is None:
        with get_client(sync_client=True) as owned:
            return crash_orphaned_flow_runs(owned)
    unfinished = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=_UNFINISHED)))
    runs: list[Any] = []
    while batch := client.read_flow_runs(flow_run_filter=unfinished, limit=200, offset=len(runs)):
        runs += batch  # all of them first: marking runs Crashed shifts the filter's pages
    crashed = []
    for run in runs:
        supervisor = Supervisor.from_tags(run.tags)
        if supervisor is None or not supervisor.gone():
            continue
        record = CrashedRun(run.id, run.name, client.read_flow(run.flow_id).name, supervisor)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=_UNFINISHED))),
        )
        for task_run in tasks:
            client.set_task_run_state(task_run.id, Crashed(message=_message(supervisor)), force=True)
            record.task_runs.append(task_run.name)
        client.set_flow_run_state(run.id, Crashed(message=_message(supervisor)), force=True)
        log.warning("%s", record.describe())
        crashed.append(record)
    return crashed


def flow_runs_of(supervisor: Supervisor, client: Any | None = None) -> list[Any]:
    """The flow runs this supervisor ran (found by its tag), newest first."""
    if client is None:
        with get_client(sync_client=True) as owned:
            return flow_runs_of(supervisor, owned)
    tagged = FlowRunFilter(tags=FlowRunFilterTags(all_=[supervisor.tag()]))
    runs = client.read_flow_runs(flow_run_filter=tagged, limit=200)
    return sorted(runs, key=lambda run: run.created or 0, reverse=True)


@dataclass
class CancelledRun:
    """A flow run marked Cancelled because its supervisor was interrupted, with the task runs marked with it."""

    flow_run_id: UUID
    flow_run_name: str
    task_runs: list[str] = field(default_factory=list)


def cancel_flow_runs(supervisor: Supervisor, message: str, client: Any | None = None) -> list[CancelledRun]:
    """Mark Cancelled this supervisor's interrupted flow runs (unfinished, or Crashed by the interrupt) and their
    unfinished or crashed task runs."""
    if client is None:
        with get_client(sync_client=True) as owned:
            return cancel_flow_runs(supervisor, message, owned)
    cancelled = []
    for run in flow_runs_of(supervisor, client):
        if run.state is None or run.state.type not in _INTERRUPTED:
            continue
        record = CancelledRun(run.id, run.name)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=_INTERRUPTED))),
        )
        for task_run in tasks:
            client.set_task_run_state(task_run.id, Cancelled(message=message), force=True)
            record.task_runs.append(task_run.name)
        client.set_flow_run_state(run.id, Cancelled(message=message), force=True)
        log.info("flow run %s (%s) marked Cancelled: %s", run.name, run.id, message)
        cancelled.append(record)
    return cancelled
