"""The ledger's files: round trip, exclusive atomic creation, malformed entries refused, stable digests, and the
current baseline moving with rollback marks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tasks.ledger.registry import CheckpointRef, Ledger, LedgerError, ServingRecord, cluster_key_of, dataset_key
from tests.unit.ledger.conftest import CLUSTER
from training.dataset import read_manifest


def test_an_entry_reads_back_equal_and_the_file_is_named_by_its_id(ledger: Ledger, make_entry) -> None:
    entry = make_entry()
    path = ledger.append(entry)
    assert Path(path).name == f"{entry.entry_id}.json"
    assert ledger.entries() == [entry]
    assert ledger.entry(entry.entry_id) == entry


def test_an_entry_is_never_rewritten_and_no_temporary_file_is_left(ledger: Ledger, make_entry) -> None:
    entry = make_entry()
    ledger.append(entry)
    with pytest.raises(LedgerError, match="exists already"):
        ledger.append(make_entry(entry_id=entry.entry_id, spec_name="other"))
    folder = Path(ledger.root) / "entries"
    assert os.listdir(folder) == [f"{entry.entry_id}.json"]
    assert ledger.entry(entry.entry_id).spec_name == "tiny"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "not a valid LedgerEntry"),
        (b'{"entry_id": "x"}', "not a valid LedgerEntry"),
        (None, "records entry"),  # another entry's content under this name
    ],
)
def test_a_malformed_entry_is_skipped_by_listings_and_refused_by_id_with_its_path_and_the_fix(
    ledger: Ledger, make_entry, content: bytes | None, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = make_entry()
    ledger.append(good)
    other = make_entry()
    path = Path(ledger.root) / "entries" / f"{other.entry_id}.json"
    path.write_bytes(content if content is not None else good.model_dump_json().encode())
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.registry"):
        assert ledger.entries() == [good]  # one bad file does not hide the others
    assert f"ledger file {path}: {problem}" in caplog.text and "skipped; move" in caplog.text
    with pytest.raises(LedgerError, match=problem) as caught:
        ledger.entry(other.entry_id)
    assert str(path) in str(caught.value)
    assert "move" in (caught.value.fix or "") and str(path) in (caught.value.fix or "")


def test_the_current_baseline_is_the_newest_entry_not_rolled_back_of_the_spec_and_cluster(
    ledger: Ledger, make_entry
) -> None:
    first, second = make_entry(), make_entry()
    other_cluster = make_entry(cluster_key="e" * 64)
    for entry in (first, second, other_cluster):
        ledger.append(entry)
    key = cluster_key_of(CLUSTER)
    assert ledger.current("tiny", key) == second
    assert ledger.mark_rolled_back([second.entry_id], first.entry_id, "test") == [second.entry_id]
    assert ledger.current("tiny", key) == first
    assert ledger.rolled_back()[second.entry_id].restored_entry == first.entry_id
    assert ledger.current("another-spec", key) is None


def test_the_current_baseline_prefers_an_entry_of_the_same_curve_identity(ledger: Ledger, make_entry) -> None:
    deploy, soak = make_entry(), make_entry(curve_key="f" * 64)
    ledger.append(deploy)
    ledger.append(soak)
    key = cluster_key_of(CLUSTER)
    assert ledger.current("tiny", key, deploy.curve_key) == deploy
    assert ledger.current("tiny", key, "0" * 64) == soak  # none of that identity: the newest


def test_digests_are_stable_and_follow_what_they_cover(tiny_dataset: str) -> None:
    manifest = read_manifest(tiny_dataset)
    assert dataset_key(manifest) == dataset_key(read_manifest(tiny_dataset))
    assert cluster_key_of(CLUSTER) == cluster_key_of(CLUSTER.model_copy())
    assert cluster_key_of(CLUSTER) != cluster_key_of(CLUSTER.model_copy(update={"procs_per_node": 4}))
    assert cluster_key_of(CLUSTER) == cluster_key_of(CLUSTER.model_copy(update={"env": {"X": "1"}}))


def _served(entry_id: str, step: int, p99: float) -> ServingRecord:
    return ServingRecord(entry_id=entry_id, recorded_at="2026-01-02T03:05:00+00:00", step=step, p99_e2e_ms=p99)


def test_the_serving_check_of_the_accepted_checkpoint_adds_its_p99_to_the_entry_once(ledger: Ledger, make_entry):
    checkpoint = CheckpointRef(url="/ckpt", step=20, commit_sha256="c" * 64)
    entry = make_entry(checkpoint=checkpoint)
    ledger.append(entry)
    written = (Path(ledger.root) / "entries" / f"{entry.entry_id}.json").read_bytes()
    assert ledger.entry(entry.entry_id).figures.serving_p99_ms is None
    assert ledger.record_serving(_served(entry.entry_id, 20, 41.5))
    assert ledger.entry(entry.entry_id).figures.serving_p99_ms == 41.5
    assert [e.figures.serving_p99_ms for e in ledger.entries()] == [41.5]
    assert not ledger.record_serving(_served(entry.entry_id, 20, 99.0))  # the first is the golden figure
    assert ledger.entry(entry.entry_id).figures.serving_p99_ms == 41.5
    assert (Path(ledger.root) / "entries" / f"{entry.entry_id}.json").read_bytes() == written  # never rewritten
    with pytest.raises(LedgerError, match="accepted step 20, but the serving check served step 30"):
        ledger.record_serving(_served(entry.entry_id, 30, 41.5))


def test_a_malformed_serving_record_is_skipped_with_a_warning_naming_it(
    ledger: Ledger, make_entry, caplog: pytest.LogCaptureFixture
) -> None:
    entry = make_entry(checkpoint=CheckpointRef(url="/ckpt", step=20, commit_sha256="c" * 64))
    ledger.append(entry)
    path = Path(ledger.root) / "serving" / f"{entry.entry_id}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"entry_id": "' + entry.entry_id + '", "p99_e2e_ms": -1}')
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.registry"):
        assert [e.figures.serving_p99_ms for e in ledger.entries()] == [None]
    assert f"ledger file {path}: not a valid ServingRecord" in caplog.text
