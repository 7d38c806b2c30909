"""What an acceptance run is for: its mode (stdlib only, so that the CLI's options name it without loading the
suite)."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """What an acceptance run is for; the check table (tasks/acceptance/checks.py) says which rows each judges."""

    FULL = "full"
    """The spec's acceptance.steps, every dimension (the recovery drill included)."""
    SOAK = "soak"
    """As full, with acceptance.soak_steps for the distributed run (the stability soak; the spec's steps where
    it sets none)."""
    CANARY = "canary"
    """A new version on a few nodes (tdeploy rollout): does it compute and perform like the baseline? No
    recovery drill: whether checkpoints restore is the full acceptance's question, after it."""
