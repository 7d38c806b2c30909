"""A race of lease contenders that all read the current record before any of them writes (shared by the lease tests)."""

from __future__ import annotations

import threading

from training.lease import Lease, LeaseHeld


def race(contenders: list[Lease]) -> tuple[list[object], list[Lease]]:
    """Every contender acquires at once, each only after all have read the lease; returns (outcomes, winners)."""
    everyone_read = threading.Barrier(len(contenders))
    for lease in contenders:
        read, seen = lease._store.read, []

        def read_together(read=read, seen=seen):  # noqa: ANN001, ANN202
            current = read()
            if not seen:
                seen.append(True)
                everyone_read.wait(timeout=30)
            return current

        lease._store.read = read_together
    outcomes: list[object] = []

    def contend(lease: Lease) -> None:
        try:
            outcomes.append(lease.acquire())
        except LeaseHeld as err:
            outcomes.append(err)

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in contenders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes, [o for o in outcomes if isinstance(o, Lease)]
