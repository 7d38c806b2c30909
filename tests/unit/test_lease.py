"""Leases on local folders and a read-back store: exclusive, stale ones taken over, renewed, lost, released."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.lease_race import race
from training import process
from training.lease import LEASE_FILE, Lease, LeaseHeld, LeaseLost, LeaseRecord


def _holder(root: Path) -> LeaseRecord:
    return LeaseRecord.from_bytes((root / LEASE_FILE).read_bytes())


def _plant(root: Path, **changes: object) -> LeaseRecord:
    """A LEASE.json as another job would have written it, with `changes` applied."""
    now = time.time()
    me = process.machine()
    record = LeaseRecord(
        url=str(root), job_id="other-job", host=me.host, pid=1, pid_start_time=process.start_time(1),
        boot_id=me.boot_id, pid_namespace=me.pid_namespace, token="t" * 32,
        started_unix_s=now - 100, renewed_unix_s=now - 10, expires_unix_s=now + 50,
    )  # fmt: skip
    record = dataclasses.replace(record, **changes)
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_FILE).write_bytes(record.to_bytes())
    return record


def _dead_process() -> tuple[int, str]:
    """The pid and start time of a process that ran and exited."""
    proc = subprocess.Popen(["sleep", "30"])
    started = process.start_time(proc.pid)
    proc.kill()
    proc.wait()
    assert started is not None
    return proc.pid, started


def test_a_second_job_is_refused_with_the_holder_and_since_when(tmp_path: Path) -> None:
    with Lease(str(tmp_path), label="run.output_url", job_id="first"):
        with pytest.raises(LeaseHeld) as refused:
            Lease(str(tmp_path), label="run.output_url", job_id="second").acquire()
        holder = refused.value.holder
        assert holder.job_id == "first" and holder.pid == os.getpid()
        message = str(refused.value)
        assert message.startswith(f"run.output_url={tmp_path}: held by pid {holder.pid} on host {holder.host}")
        assert "(job first) since " in message and "(expires " in message
        assert "wait for it, cancel that job, or use another run.output_url" in message
    assert not (tmp_path / LEASE_FILE).exists()  # released on exit


def test_a_lease_whose_holder_process_is_gone_is_taken_over_with_a_warning(tmp_path: Path, caplog) -> None:
    pid, started = _dead_process()
    _plant(tmp_path, pid=pid, pid_start_time=started)
    with caplog.at_level(logging.WARNING, logger="training.lease"):
        with Lease(str(tmp_path), label="checkpoint.url", job_id="mine") as lease:
            assert _holder(tmp_path).token == lease.record.token
    assert f"took over a stale lease held by pid {pid} on host" in caplog.text
    assert f"its holder pid {pid} on {process.machine().host} is gone" in caplog.text


def test_a_live_lease_of_another_machine_holds_until_it_expires(tmp_path: Path, caplog) -> None:
    planted = _plant(tmp_path, host="elsewhere", boot_id="another-boot", pid=424242, pid_start_time="1")
    with pytest.raises(LeaseHeld, match="held by pid 424242 on host elsewhere"):
        Lease(str(tmp_path), job_id="mine").acquire()
    later = planted.expires_unix_s + 1
    with caplog.at_level(logging.WARNING, logger="training.lease"):
        with Lease(str(tmp_path), job_id="mine", clock=lambda: later):
            assert _holder(tmp_path).job_id == "mine"
    assert "took over a stale lease held by pid 424242 on host elsewhere" in caplog.text and "expired at" in caplog.text


def test_a_restarted_attempt_of_the_same_job_takes_its_lease_back_without_a_warning(tmp_path: Path, caplog) -> None:
    _plant(tmp_path, job_id="job-7", pid=os.getpid(), pid_start_time="1")
    with caplog.at_level(logging.WARNING, logger="training.lease"):
        with Lease(str(tmp_path), job_id="job-7"):
            assert _holder(tmp_path).pid == os.getpid()
    assert "took over" not in caplog.text


def test_the_heartbeat_moves_the_expiry_forward(tmp_path: Path) -> None:
    with Lease(str(tmp_path), job_id="mine", ttl_s=0.3) as lease:
        first = _holder(tmp_path)
        deadline = time.monotonic() + 30
        while _holder(tmp_path).expires_unix_s == first.expires_unix_s:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        renewed = _holder(tmp_path)
        assert renewed.token == first.token and renewed.started_unix_s == first.started_unix_s
        assert renewed.expires_unix_s > first.expires_unix_s and lease.held


def test_a_lease_taken_over_after_it_expired_is_lost_and_its_release_leaves_the_new_holder(tmp_path: Path) -> None:
    old = Lease(str(tmp_path), job_id="old", ttl_s=3600).acquire()
    expired = old.record.expires_unix_s + 1
    new = Lease(str(tmp_path), job_id="new", clock=lambda: expired).acquire()
    try:
        assert old.renew() is False
        with pytest.raises(LeaseLost, match=r"now held by pid \d+ on host .* \(job new\)"):
            old.check()
        old.release()
        assert _holder(tmp_path).job_id == "new"
    finally:
        new.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_of_many_contenders_that_all_saw_a_stale_lease_exactly_one_wins(tmp_path: Path) -> None:
    pid, started = _dead_process()
    _plant(tmp_path, pid=pid, pid_start_time=started)
    contenders = [Lease(str(tmp_path), job_id=f"job-{i}") for i in range(4)]
    outcomes, winners = race(contenders)
    try:
        assert len(outcomes) == 4 and len(winners) == 1
        assert _holder(tmp_path).job_id == winners[0].job_id
    finally:
        for winner in winners:
            winner.release()


def test_a_store_without_conditional_writes_still_refuses_a_second_job(monkeypatch) -> None:
    url = f"memory://lease-test-{time.time_ns()}/checkpoints"
    with Lease(url, label="checkpoint.url", job_id="first", settle_s=0.01):
        with pytest.raises(LeaseHeld, match=f"checkpoint.url={url}: held by pid"):
            Lease(url, label="checkpoint.url", job_id="second", settle_s=0.01).acquire()
    with Lease(url, job_id="second", settle_s=0.01) as lease:  # released: free again
        assert lease.held
