"""The checkpoint signing key can live in a Prefect Secret block instead of the operator's environment."""

from __future__ import annotations

import os

import pytest
from prefect.blocks.system import Secret

from tasks.pipeline import CHECKPOINT_KEY_BLOCK, checkpoint_key_from_secret_block


def test_the_secret_block_fills_the_checkpoint_key_only_when_the_environment_has_none(
    prefect_harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDEPLOY_CHECKPOINT_KEY", "restored-after-the-test")  # so that monkeypatch undoes our writes
    monkeypatch.delenv("TDEPLOY_CHECKPOINT_KEY")
    assert checkpoint_key_from_secret_block() is False  # no block yet: nothing set
    assert "TDEPLOY_CHECKPOINT_KEY" not in os.environ

    Secret(value="block-key-0123456789abcdef").save(CHECKPOINT_KEY_BLOCK, overwrite=True)
    try:
        assert checkpoint_key_from_secret_block() is True
        assert os.environ["TDEPLOY_CHECKPOINT_KEY"] == "block-key-0123456789abcdef"

        monkeypatch.setenv("TDEPLOY_CHECKPOINT_KEY", "operator-key-0123456789")
        assert checkpoint_key_from_secret_block() is False  # the operator's own variable wins
        assert os.environ["TDEPLOY_CHECKPOINT_KEY"] == "operator-key-0123456789"
    finally:
        # Every later flow run of this test session would take the key from the block otherwise.
        Secret.delete(CHECKPOINT_KEY_BLOCK)
