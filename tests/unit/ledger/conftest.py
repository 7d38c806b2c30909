"""Ledger entries built by hand (no jobs): figures, a ledger folder, an entry factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.launch.cluster import ClusterConfig
from tasks.ledger.registry import GoldenFigures, Ledger, LedgerEntry, cluster_identity, cluster_key_of
from tasks.run_id import new_run_id

CLUSTER = ClusterConfig(scheduler="local", nodes=1, procs_per_node=2, accelerator="cpu")
CURVE_KEY = "c" * 64


def figures(**overrides: float | None) -> GoldenFigures:
    """Golden figures of a 20-step run: a falling curve, 1000 tokens/s, 0.5 s steps, 2 s saves."""
    curve = {s: 5.0 - 0.1 * s for s in range(1, 21)}
    base = {
        "loss_curve": curve,
        "first_loss": curve[1],
        "final_loss": curve[20],
        "val_loss": 3.0,
        "tokens_per_s": 1000.0,
        "step_time_s": 0.5,
        "comm_share": 0.2,
        "checkpoint_save_s": 2.0,
        "busbw_gbps": None,
    }
    return GoldenFigures.model_validate({**base, **overrides})


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    """An empty ledger on local disk."""
    return Ledger(str(tmp_path / "ledger"))


@pytest.fixture
def make_entry() -> Callable[..., LedgerEntry]:
    """A valid entry of spec `tiny` on CLUSTER (fields overridable)."""

    def factory(**overrides: object) -> LedgerEntry:
        data = {
            "entry_id": new_run_id(),
            "created_at": "2026-01-02T03:04:05+00:00",
            "spec_name": "tiny",
            "spec_digest": "a" * 64,
            "cluster_key": cluster_key_of(CLUSTER),
            "cluster": cluster_identity(CLUSTER),
            "curve_key": CURVE_KEY,
            "image_ref": "registry.local/tdeploy@sha256:" + "b" * 64,
            "image_digest": "sha256:" + "b" * 64,
            "code_version": "0.1.0+gabcdef123456",
            "dataset_key": "d" * 64,
            "train": {"model": {}},
            "checkpoint": None,
            "figures": figures(),
            "acceptance_run": "/runs/tiny/acceptance/x",
            **overrides,
        }
        return LedgerEntry.model_validate(data)

    return factory
