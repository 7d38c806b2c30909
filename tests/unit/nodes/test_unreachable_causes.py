"""Which of ssh's failures may pass by themselves (retried) and which need a fix (never retried)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tasks.errors import TransientError, UserError
from tasks.nodes.check import NodeCheckFailed, NodesUnreachable, build_report, raise_for_blocking

PREFIX = 'Task failed: Data could not be sent to remote host "10.0.0.3". Make sure this host can be reached over ssh: '
NOT_TRANSIENT = [
    ("ssh: connect to host 10.0.0.3 port 22: Connection refused", "start sshd on node-b"),
    ("ssh: connect to host 10.0.0.3 port 22: No route to host", "no network route from the controller to node-b"),
    ("ssh: connect to host 10.0.0.3 port 22: Network is unreachable", "no network route"),
    ("ssh: Could not resolve hostname node-b: Name or service not known", "fix the address of node-b"),
    ("ssh: Could not resolve hostname node-b: Temporary failure in name resolution", "fix the address of node-b"),
]
TRANSIENT = [
    "ssh: connect to host 10.0.0.3 port 22: Connection timed out",
    "kex_exchange_identification: read: Connection reset by peer",
    "Connection closed by 10.0.0.3 port 22",
]


@pytest.mark.parametrize(("message", "fix"), NOT_TRANSIENT)
def test_refused_unroutable_and_unknown_hosts_fail_at_once_with_the_host_and_the_fix(
    make_run: Callable, make_plan: Callable, message: str, fix: str
) -> None:
    report = build_report(
        make_run({"node-a": None, "node-b": {"unreachable": PREFIX + message}}), make_plan(["node-a", "node-b"])
    )
    with pytest.raises(NodeCheckFailed) as failed:
        raise_for_blocking(report, retries_left=2)
    assert isinstance(failed.value, UserError) and failed.value.hosts == ["node-b"]
    assert fix in str(failed.value) and "retrying" not in str(failed.value)


@pytest.mark.parametrize("message", TRANSIENT)
def test_timeouts_and_dropped_connections_are_retried_and_the_last_try_says_no_retry_is_left(
    make_run: Callable, make_plan: Callable, message: str
) -> None:
    report = build_report(
        make_run({"node-a": None, "node-b": {"unreachable": PREFIX + message}}), make_plan(["node-a", "node-b"])
    )
    with pytest.raises(NodesUnreachable) as retried:
        raise_for_blocking(report, retries_left=1)
    assert isinstance(retried.value, TransientError) and "retrying (1 more attempt(s))" in str(retried.value)
    with pytest.raises(NodesUnreachable) as last:
        raise_for_blocking(report, retries_left=0)
    assert "retrying" not in str(last.value) and "no retry left" in str(last.value)
