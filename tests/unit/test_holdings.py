"""What a rank records that it runs (training/holdings.py `held_layers`, ranks.json mesh `layers`): each model
kind's transformer layers by global index, a vision-language model's language-model and vision layers both."""

from __future__ import annotations

from training.config import ModelConfig
from training.holdings import held_layers
from training.model import Transformer
from training.vision import VisionTransformer
from training.vlm import VisionLanguageModel

VISION = {"image_size": 16, "patch_size": 8, "n_layers": 2, "d_model": 32, "n_heads": 1, "ffn_hidden": 64,
          "pooling": "mean"}  # fmt: skip
LM = {"n_layers": 3, "d_model": 32, "n_heads": 2, "ffn_hidden": 64, "vocab_size": 64, "seq_len": 16}


def test_a_language_model_and_a_vit_record_their_layers() -> None:
    lm = Transformer(ModelConfig.model_validate({**LM, "kind": "lm"}))
    assert held_layers(lm) == {"layers": [0, 1, 2], "experts": {}}
    vit = ModelConfig.model_validate({"kind": "vit", "vision": {**VISION, "num_classes": 3}})
    assert held_layers(VisionTransformer(vit.vision, 3)) == {"layers": [0, 1], "experts": {}}


def test_a_vision_language_model_records_its_language_and_vision_layers() -> None:
    model = VisionLanguageModel(ModelConfig.model_validate({**LM, "kind": "vlm", "vocab_size": 65,
                                                             "seq_len": 4 + 8, "vision": VISION}))  # fmt: skip
    held = held_layers(model)
    # `layers` are the ones model.n_layers counts (acceptance's placement check reads them against it)
    assert held == {"layers": [0, 1, 2], "experts": {}, "vision_layers": [0, 1]}
    assert len(held["layers"]) == model.cfg.n_layers and len(held["vision_layers"]) == model.cfg.vision.n_layers


def test_acceptance_finds_every_layer_of_a_tensor_parallel_vision_language_job_placed() -> None:
    from training.layout import MESH_DIMS
    from validation.acceptance import placement_problems

    model = VisionLanguageModel(ModelConfig.model_validate({**LM, "kind": "vlm", "vocab_size": 65,
                                                             "seq_len": 4 + 8, "vision": VISION}))  # fmt: skip
    dims = {**dict.fromkeys(MESH_DIMS, 1), "tp": 2, "ep": 1}
    coords = {rank: {**dict.fromkeys(MESH_DIMS, 0), "tp": rank} for rank in (0, 1)}
    meshed = {rank: {**held_layers(model), "n_layers": 3, "n_experts": 0} for rank in (0, 1)}
    assert placement_problems(meshed, coords, dims) == []
