"""The diagnosis names the hardening refusals (untrusted files, a folder in use, a full disk) as their own causes."""

from __future__ import annotations

import pytest

from tasks.diagnose import diagnose


@pytest.mark.parametrize(
    ("log", "cause"),
    [
        (
            "[rank0]: training.checkpoint.trust.UnsafeCheckpointError: refusing to load /ck/step-00000010/.metadata: "
            "global not allowed (posix.system)",
            "untrusted checkpoint or dataset refused",
        ),
        (
            "[rank1]: training.checkpoint.trust.CheckpointKeyError: /ck/step-00000010: signed; "
            "set TDEPLOY_CHECKPOINT_KEY",
            "untrusted checkpoint or dataset refused",
        ),
        (
            "[rank0]: training.dataset.DatasetError: manifest.json splits.train.shards[0].tokens='../../etc/passwd' "
            "climbs out of the dataset root ('..')",
            "untrusted checkpoint or dataset refused",
        ),
        (
            "[rank0]: training.lease.LeaseHeld: run.output_url=/runs/a: held by pid 4242 on host h1 since 10:00",
            "run folder in use by another job",
        ),
        (
            "CheckpointSaveError: no space left on /ck/step-00000020: checkpoint needs ~231.0 MB, 12.0 MB free",
            "checkpoint save failure",
        ),
    ],
)
def test_each_hardening_refusal_is_diagnosed_as_its_own_cause(log: str, cause: str) -> None:
    findings = diagnose("training failed", log).findings
    assert [f.cause for f in findings] == [cause]
    assert log.strip()[:60] in findings[0].evidence[0]


@pytest.mark.parametrize(
    "log",
    [
        "[rank0]: training.dataset.DatasetError: runs/local/datasets/8bc7c958d63cad69: the dataset does not exist; "
        "prepare it first (tdeploy prepare-data)",
        "[rank1]: training.dataset.DatasetError: runs/local/datasets/8bc7: is unfinished (no manifest.json); rebuild it",
        "[rank0]: training.dataset.DatasetError: /data/ds: train/tokens-00000.bin is missing; re-copy the dataset",
    ],
)
def test_a_dataset_that_is_not_there_is_diagnosed_as_missing_not_as_tampered(log: str) -> None:
    findings = diagnose("training failed", log).findings
    assert [f.cause for f in findings] == ["dataset or checkpoint missing"]
    assert "planted" not in findings[0].fix and "run the deployment again" in findings[0].fix
