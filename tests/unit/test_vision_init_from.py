"""model.vision.init_from: the spec's refusals, config.json disagreements named with both values, safetensors only,
the shared name table's round trip (and the exporters using it), and a ViT classifier loaded with or without its
head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from tasks.export import vit as vit_export
from tasks.export import vlm as vlm_export
from training import hf_vision_names
from training.config import ModelConfig, VisionConfig
from training.hf_load import HFLoadError
from training.hf_vision_load import check_vision_config, load_vision_into, vision_config_problems
from training.vision import VisionTransformer

VIT = {"image_size": 16, "patch_size": 8, "n_layers": 2, "d_model": 16, "n_heads": 2, "ffn_hidden": 32,
       "pooling": "cls", "num_classes": 3}  # fmt: skip
SIGLIP_JSON = {"model_type": "siglip_vision_model", "image_size": 16, "patch_size": 8, "num_channels": 3,
               "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
               "layer_norm_eps": 1e-6, "hidden_act": "gelu"}  # fmt: skip


def _vision(**changes: object) -> VisionConfig:
    return VisionConfig.model_validate({**VIT, "pooling": "mean", "num_classes": None, **changes})


def test_every_disagreement_is_named_with_both_values() -> None:
    config = {**SIGLIP_JSON, "hidden_size": 24, "num_hidden_layers": 3, "layer_norm_eps": 1e-5,
              "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip
    problems = vision_config_problems(config, _vision(), "vlm")
    text = "; ".join(problems)
    assert "hidden_size=24 in config.json but model.vision.d_model=16" in text
    assert "num_hidden_layers=3 in config.json but model.vision.n_layers=2" in text
    assert "layer_norm_eps=1e-05 in config.json but model.vision.norm_eps=1e-06" in text
    assert "hidden_act=gelu_pytorch_tanh" in text and "exact GELU" in text
    assert len(problems) == 4, problems
    assert vision_config_problems(SIGLIP_JSON, _vision(), "vlm") == []


def test_the_model_type_must_fit_the_kind() -> None:
    assert "kind vit starts from a ViTModel" in vision_config_problems(SIGLIP_JSON, _vision(), "vit")[0]
    assert "siglip_vision_model" in vision_config_problems({**SIGLIP_JSON, "model_type": "siglip"}, _vision(),
                                                           "vlm")[0]  # fmt: skip
    custom = vision_config_problems({**SIGLIP_JSON, "auto_map": {"x": "y"}}, _vision(), "vlm")
    assert custom and custom[0].startswith("auto_map=")


def test_a_folder_of_pickle_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SIGLIP_JSON))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(HFLoadError, match="pickle"):
        check_vision_config(str(tmp_path), _vision(), "vlm")
    (tmp_path / "config.json").write_text(json.dumps({**SIGLIP_JSON, "patch_size": 4}))
    with pytest.raises(HFLoadError, match=r"patch_size=4 in config.json but model.vision.patch_size=8"):
        check_vision_config(str(tmp_path), _vision(), "vlm")


def test_the_spec_refuses_what_a_tower_cannot_start() -> None:
    with pytest.raises(ValidationError, match="vision.pooling"):
        ModelConfig.model_validate({"kind": "vit", "vision": {**VIT, "pooling": "mean", "init_from": "/x"}})
    with pytest.raises(ValidationError, match="model.vision.init_from"):
        ModelConfig.model_validate({"kind": "vit", "vision": VIT, "init_from": "/x"})
    ok = ModelConfig.model_validate({"kind": "vit", "vision": {**VIT, "init_from": "/x"}})
    assert ok.vision is not None and str(ok.vision.init_from) == "/x"


def test_the_name_table_round_trips_and_the_exporters_use_it() -> None:
    for pooling, table in (("cls", hf_vision_names.VIT), ("mean", hf_vision_names.SIGLIP)):
        model = VisionTransformer(VisionConfig.model_validate({**VIT, "pooling": pooling}), 3)
        for name, _ in model.named_parameters():
            if name.startswith("head.") or (pooling == "mean" and name.startswith("norm.")):
                continue
            theirs = hf_vision_names.translate(name, table)
            assert theirs is not None, name
            assert hf_vision_names.translate(theirs, table, reverse=True) == name
    assert vit_export.hf_name("blocks.1.attn.wq.bias") == "vit.encoder.layer.1.attention.attention.query.bias"
    assert vit_export.hf_name("head.weight") == "classifier.weight"
    assert vlm_export.hf_name("vision.blocks.0.mlp.w2.weight") == "vision_tower.encoder.layers.0.mlp.fc2.weight"
    assert vlm_export.our_name("vision_tower.embeddings.position_embedding.weight") == "vision.pos_emb"
    assert set(vit_export._TABLE) >= set(hf_vision_names.prefixed(hf_vision_names.VIT, "", "vit."))


@pytest.mark.parametrize("labels", [3, 5])
def test_a_vit_classifier_loads_its_head_only_when_the_class_count_matches(tmp_path: Path, labels: int) -> None:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, layer_norm_eps=1e-6, num_labels=labels)  # fmt: skip
    theirs = ViTForImageClassification(config).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    model = ModelConfig.model_validate({"kind": "vit", "vision": {**VIT, "init_from": str(tmp_path)}})
    assert model.vision is not None
    ours = VisionTransformer(model.vision, 3)
    head_before = ours.head.weight.detach().clone()
    loaded = load_vision_into(ours, model)
    state = load_file(str(tmp_path / "model.safetensors"))  # the file's names (transformers 5 renames in memory)
    assert torch.equal(ours.blocks["1"].attn.wk.weight, state["vit.encoder.layer.1.attention.attention.key.weight"])
    assert torch.equal(ours.cls_token, state["vit.embeddings.cls_token"])
    if labels == 3:
        assert loaded == len(list(ours.parameters()))
        pixels = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
        with torch.no_grad():
            want = theirs(pixel_values=(pixels.float() / 255 - 0.5) / 0.5).logits
            assert (ours(pixels) - want).abs().max() < 1e-5
    else:
        assert loaded == len(list(ours.parameters())) - 2 and torch.equal(ours.head.weight, head_before)
