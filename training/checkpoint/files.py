"""The files of a checkpoint folder: their names, the step folders' names and the pins beside them."""

from __future__ import annotations

import re

COMMIT = "COMMIT.json"
TRAIN_STATE = "train_state.json"
MODEL_CARD = "model.json"
MODEL_PREFIX = "model."  # DCP's flattened key of a model tensor: "model." + the module's parameter name
DCP_METADATA = ".metadata"  # DCP's own name (torch.distributed.checkpoint.filesystem)
STEP_DIR = re.compile(r"step-(\d{8})$")

PINS_DIR = "pins"
"""Beside the step folders: `pins/step-<N>.<holder>`, one file per holder (a ledger entry) that needs checkpoint N
kept. Retention (keep_last, and making room on a full disk) never deletes a pinned step."""

PIN = re.compile(r"^step-(\d{8})\.([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"step-{step:08d}"


def rng_file(rank: int) -> str:
    """The RNG file of `rank`, relative to a step folder."""
    return f"rng/rank-{rank:05d}.json"


def loader_files(world_size: int) -> list[str]:
    """The small files every resume reads (besides the DCP shards .metadata names): what a commit must list."""
    return [DCP_METADATA, TRAIN_STATE, *(rng_file(rank) for rank in range(world_size))]
