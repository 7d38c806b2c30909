"""model.vision.init_from: a tiny SiglipVisionModel saved by transformers starts a vlm's encoder. In process, the
loaded encoder's weights are transformers' and its patch features equal transformers' last hidden state; under the
real trainer (torchrun, one process) the run trains from it, and a spec that disagrees with the tower's config.json
refuses to start as a workload error (bad_model) naming both values, before any step."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tasks.launch.torchrun import free_port
from tests.integration.vlm_setup import CAPTION_LEN, PATCHES, SIZE, VOCAB, caption_dataset
from tests.processes import run_group
from training.config import ReferenceConfig, TrainConfig
from training.failure import read_failure
from training.hf_vision_load import load_vision_into
from training.hf_vision_names import SIGLIP, translate
from training.reference import run_reference
from training.run_output import RunOutput
from training.vlm import VisionLanguageModel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
VISION = {"image_size": SIZE, "patch_size": 8, "n_layers": 2, "d_model": 32, "n_heads": 2, "ffn_hidden": 64,
          "pooling": "mean"}  # fmt: skip


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random SiglipVisionModel of the spec's shape (norms and biases random too, so a misplaced one shows)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(image_size=SIZE, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64, hidden_act="gelu",
                                layer_norm_eps=1e-6, num_channels=3)  # fmt: skip
    model = SiglipVisionModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("siglip")
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _config(root: Path, dataset: str, tower: str, **vision: Any) -> TrainConfig:
    model = {"kind": "vlm", "vision": {**VISION, "init_from": tower, **vision}, "n_layers": 1, "d_model": 32,
             "n_heads": 2, "ffn_hidden": 64, "vocab_size": VOCAB + 1, "seq_len": PATCHES + CAPTION_LEN}  # fmt: skip
    return TrainConfig.model_validate({
        "model": model,
        "parallel": {"sharding": "ddp", "micro_batch": 2, "grad_accum_steps": 1},
        "optim": {"lr_peak": 1e-3, "warmup_steps": 1},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None, "save_at_end": False,
                       "memory_every_steps": 0},
        "run": {"steps": 1, "seed": 5, "output_url": str(root / "output"), "threads_per_rank": 1,
                "log_every_steps": 1, "eval_every_steps": 1},
        "watchdog": {"enabled": False},
    })  # fmt: skip


def _train(cfg: TrainConfig) -> Any:
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "training.train", "--config", str(out / "run.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TDEPLOY_CHECKPOINT_KEY", None)
    return run_group(cmd, timeout=100, env=env, cwd=REPO)


def test_the_encoder_loads_transformers_weights_and_computes_its_features(tower: str, tmp_path: Path) -> None:
    from transformers import SiglipVisionModel

    cfg = _config(tmp_path, str(tmp_path / "unused"), tower)
    torch.manual_seed(1)
    ours = VisionLanguageModel(cfg.model)
    projector_before = ours.projector.linear_1.weight.clone()
    assert load_vision_into(ours, cfg.model) == len(list(ours.vision.parameters()))
    theirs = SiglipVisionModel.from_pretrained(tower).eval()
    state = theirs.state_dict()
    for name, param in ours.vision.named_parameters():
        key = translate(name, SIGLIP)  # transformers 5 saves the tower unprefixed, 4.x under vision_model.
        source = state[key] if key in state else state[f"vision_model.{key}"]
        assert torch.equal(param.detach(), source.reshape(param.shape)), name
    assert torch.equal(ours.projector.linear_1.weight, projector_before), "the projector stays as initialised"

    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 3, SIZE, SIZE), dtype=np.uint8))
    with torch.no_grad():
        mine = ours.vision.features(pixels)
        hidden = theirs(pixel_values=(pixels.float() / 255 - 0.5) / 0.5, output_hidden_states=True).hidden_states[-1]
    assert mine.shape == hidden.shape
    assert (mine - hidden).abs().max() <= 1e-4 * hidden.abs().max(), (mine - hidden).abs().max()


def test_a_vlm_trains_from_the_tower_and_a_disagreeing_spec_is_refused_before_training(
    tower: str, tmp_path: Path
) -> None:
    dataset = caption_dataset(tmp_path)
    done = _train(_config(tmp_path / "good", dataset, tower))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "model.vision.init_from=" in done.stderr and "encoder tensors loaded" in done.stderr
    # The plain reference starts from the same weights: the same first loss as the trainer's.
    good = _config(tmp_path / "good", dataset, tower)
    ref = good.model_copy(update={"reference": ReferenceConfig(world_size=1),
                                  "run": good.run.model_copy(update={"output_url": str(tmp_path / "ref")})})
    trained = RunOutput(good.run.output_url).metrics(0)[1].loss
    assert abs(run_reference(ref).first_loss - trained) <= 1e-5 * abs(trained), (trained,)

    bad = _config(tmp_path / "bad", dataset, tower, n_heads=4)
    done = _train(bad)
    assert done.returncode != 0
    failure = read_failure(bad.run.output_url)
    assert failure is not None and failure.cause == "bad_model", failure
    assert "num_attention_heads=2 in config.json but model.vision.n_heads=4" in failure.error, failure.error
    metrics = Path(bad.run.output_url) / "metrics"
    assert not metrics.exists() or not any(metrics.iterdir()), "no step was trained"
