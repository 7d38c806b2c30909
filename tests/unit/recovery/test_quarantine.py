"""The node memory: failures within the window quarantine a host until an operator clears it; files are untrusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.quarantine import NodeMemory
from training.checkpoint import KEY_ENV

HOUR = 3600.0


def _memory(tmp_path: Path, **config: float) -> NodeMemory:
    return NodeMemory(str(tmp_path / "ledger" / "nodes"), RecoveryConfig(**config))


def test_two_failures_within_the_window_quarantine_a_host_until_an_operator_clears_it(tmp_path: Path) -> None:
    memory = _memory(tmp_path, quarantine_after_failures=2, quarantine_window_s=HOUR)
    assert not memory.record_failure("node-2", "lost_node", job="ssh:a", now=1000.0).quarantined
    state = memory.record_failure("node-2", "lost_rank", job="ssh:b", now=1000.0 + HOUR / 2)
    assert state.quarantined and state.quarantined_since_unix_s == 1000.0 + HOUR / 2
    assert "failed 2 times" in state.reason and "lost_node" in state.reason
    # it stays quarantined however long ago the failures were: only a clear ends it
    again = NodeMemory(memory.url, memory.config)  # another process reading the same folder
    assert again.quarantined() == ["node-2"]
    cleared = again.clear("node-2", "DIMM replaced", now=1000.0 + 10 * HOUR)
    assert not cleared.quarantined and cleared.failures == []
    # after the clear the old failures no longer count: one new failure is not enough
    assert not memory.record_failure("node-2", "lost_node", now=1000.0 + 11 * HOUR).quarantined


def test_failures_further_apart_than_the_window_do_not_quarantine(tmp_path: Path) -> None:
    memory = _memory(tmp_path, quarantine_after_failures=2, quarantine_window_s=HOUR)
    memory.record_failure("node-1", "lost_node", now=0.0)
    assert not memory.record_failure("node-1", "lost_node", now=2 * HOUR).quarantined
    assert memory.record_failure("node-1", "hang", now=2.5 * HOUR).quarantined  # two within the last hour


def test_an_operator_quarantines_a_host_by_hand_and_the_list_shows_every_known_host(tmp_path: Path) -> None:
    memory = _memory(tmp_path)
    memory.record_failure("node-1", "lost_rank", now=5.0)
    assert memory.quarantine("node-3", "ECC errors", now=10.0).quarantined
    states = memory.states()
    assert list(states) == ["node-1", "node-3"]
    assert not states["node-1"].quarantined and states["node-3"].reason == "ECC errors"
    assert memory.quarantined() == ["node-3"]


@pytest.mark.parametrize("host", ["node-1; rm -rf /", "node[1-3]", "../etc", "-x", "", "node 1", "a,b"])
def test_a_hostile_host_name_is_refused_before_anything_is_written(tmp_path: Path, host: str) -> None:
    memory = _memory(tmp_path)
    with pytest.raises(UserError, match="is not a host name"):
        memory.quarantine(host)
    assert not (tmp_path / "ledger" / "nodes").exists() or not list((tmp_path / "ledger" / "nodes").iterdir())


def test_with_the_key_set_an_unsigned_planted_clear_is_skipped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 40)
    memory = _memory(tmp_path)
    memory.quarantine("node-2", "bad GPU", now=10.0)
    planted = {"kind": "clear", "host": "node-2", "time_unix_s": 20.0, "reason": "", "job": None}
    (tmp_path / "ledger" / "nodes" / "20991231T000000.000000Z-abcdef.json").write_text(json.dumps(planted))
    assert memory.quarantined() == ["node-2"]  # the planted clear did not return the host to service
    monkeypatch.delenv(KEY_ENV)
    assert _memory(tmp_path).quarantined() == []  # without a key it is read, as the ledger's files are
