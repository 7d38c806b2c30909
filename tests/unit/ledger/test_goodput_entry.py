"""A ledger entry keeps the accepted run's goodput, and `tdeploy history`'s line shows it."""

from __future__ import annotations

from tasks.ledger.registry import Ledger
from validation.goodput import Goodput

GOODPUT = Goodput(200.0, 150.0, {"queue": 20.0, "startup": 10.0, "recovery": 12.0, "redone_steps": 8.0})


def test_the_ledger_keeps_the_entry_goodput_and_history_shows_it(ledger: Ledger, make_entry) -> None:  # noqa: ANN001
    with_goodput, before = make_entry(goodput=GOODPUT.to_json()), make_entry()
    ledger.append(with_goodput)
    ledger.append(before)
    entries = {e.entry_id: e for e in ledger.entries()}
    assert entries[with_goodput.entry_id].goodput == GOODPUT
    assert entries[with_goodput.entry_id].line().endswith("goodput 75.0%")
    assert entries[before.entry_id].goodput is None and entries[before.entry_id].line().endswith("goodput -")
