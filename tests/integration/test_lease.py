"""Leases on a real S3 endpoint (moto's server): conditional writes make them exclusive."""

from __future__ import annotations

import pytest

from tests.lease_race import race
from training.lease import LEASE_FILE, Lease, LeaseHeld, LeaseLost, LeaseRecord
from training.storage import StorageConfig, filesystem

pytestmark = pytest.mark.integration


def _record(url: str, storage: StorageConfig) -> LeaseRecord | None:
    fs, root = filesystem(url, storage)
    path = f"{root}/{LEASE_FILE}"
    return LeaseRecord.from_bytes(fs.cat_file(path)) if fs.exists(path) else None


def test_an_s3_lease_refuses_a_second_job_and_is_gone_after_release(s3_endpoint: str, s3_bucket: str) -> None:
    storage = StorageConfig(s3_endpoint_url=s3_endpoint)
    url = f"s3://{s3_bucket}/checkpoints"
    with Lease(url, storage, label="checkpoint.url", job_id="first") as lease:
        assert _record(url, storage).token == lease.record.token
        with pytest.raises(LeaseHeld, match=rf"checkpoint.url={url}: held by pid \d+ on host .* \(job first\) since"):
            Lease(url, storage, label="checkpoint.url", job_id="second").acquire()
        assert lease.renew() and _record(url, storage).token == lease.record.token
    assert _record(url, storage) is None


def test_racing_takeovers_of_a_stale_s3_lease_have_exactly_one_winner(s3_endpoint: str, s3_bucket: str) -> None:
    storage = StorageConfig(s3_endpoint_url=s3_endpoint)
    url = f"s3://{s3_bucket}/run"
    stale = Lease(url, storage, job_id="stale", ttl_s=3600).acquire()
    stale._stop.set()  # its heartbeat stops, as a dead holder's would
    expired = stale.record.expires_unix_s + 1
    contenders = [Lease(url, storage, job_id=f"job-{i}", clock=lambda: expired) for i in range(3)]
    outcomes, winners = race(contenders)
    try:
        assert len(outcomes) == 3 and len(winners) == 1
        assert _record(url, storage).job_id == winners[0].job_id
        assert stale.renew() is False  # the old holder finds out at its next renewal
        with pytest.raises(LeaseLost, match=f"now held by .* \\(job {winners[0].job_id}\\)"):
            stale.check()
        stale.release()
        assert _record(url, storage).job_id == winners[0].job_id  # its release leaves the new holder's lease
    finally:
        for winner in winners:
            winner.release()
