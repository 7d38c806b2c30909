"""Every checkpoint of a real training run holds its model card (model.json), listed in COMMIT.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.launch.local import run_local
from training.checkpoint import COMMIT, MODEL_CARD, CheckpointManager, step_dir_name
from training.dataset import read_manifest

pytestmark = pytest.mark.integration

# head_dim 32 (d_model 64 / 2 heads, one KV head): the shape of examples/local.yaml's model
MODEL = {"d_model": 64, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 96, "tie_embeddings": True}


def test_a_training_run_leaves_a_model_card_in_each_checkpoint(make_spec) -> None:
    spec = make_spec({"model": MODEL, "run": {"steps": 4, "log_every_steps": 2}, "checkpoint": {"save_every_steps": 2}})
    cfg = spec.training_config()
    run_local(spec.cluster, cfg)
    manager = CheckpointManager(cfg.checkpoint, cfg.storage)
    assert manager.committed_steps() == [2, 4]
    manifest = read_manifest(cfg.data.dataset_url)
    for step in (2, 4):
        folder = Path(cfg.checkpoint.url) / step_dir_name(step)
        commit = json.loads((folder / COMMIT).read_text())
        assert MODEL_CARD in commit["files"], sorted(commit["files"])
        card = manager.read_card(step, manager.sound(step))
        assert card is not None and card.model == cfg.model and card.model.head_dim == 32
        assert card.dataset_url == cfg.data.dataset_url and card.vocab_size == manifest.vocab_size == 257
        assert card.eos_id == manifest.eos_id == 256 and card.tokenizer.kind == "bytes"
        assert card.tokenizer.url is None and card.expert_capacity_factor is None
