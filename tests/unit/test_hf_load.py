"""model.init_from in one process: config.json read and refused field by field, safetensors only, the name table
both ways, weights (and slices of them) loaded to transformers' logits, the spec's fields filled or refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.init_from import fill_model
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import ModelConfig
from training.hf_config import HFLoadError, read_hf_config
from training.hf_load import (
    InitCheck,
    check_prompt,
    load_hf_state,
    read_init_check,
    write_init_check,
)
from training.hf_names import hf_name, our_name
from training.model import Transformer

SHAPE = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}  # fmt: skip


def _save(folder: Path, kind: str = "llama", **overrides: Any) -> Path:
    """A random-init model saved by transformers (safetensors), config.json fields overridden afterwards."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_theta=5000.0, initializer_range=0.2))
    else:
        model = MixtralForCausalLM(MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(folder)
    if overrides:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **overrides}))
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("llama"))


def _ours(folder: Path, seq_len: int = 16) -> tuple[ModelConfig, Transformer]:
    arch = read_hf_config(str(folder))
    cfg = ModelConfig(**arch.fields, seq_len=seq_len, init_from=str(folder))
    model = Transformer(cfg)
    state = load_hf_state(str(folder), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    return cfg, model.eval()


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_a_transformers_model_loads_to_the_same_logits(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = _save(tmp_path / kind, kind)
    cfg, ours = _ours(folder)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([check_prompt(cfg.vocab_size, cfg.seq_len)])
    with torch.no_grad():
        reference = theirs(ids).logits
        assert (ours(ids)[0] - reference).abs().max() < 1e-5 * reference.abs().max()
    assert cfg.rope_theta == (5000.0 if kind == "llama" else 1e6) and (cfg.moe is not None) == (kind == "mixtral")


def test_the_config_field_that_changes_the_function_is_read_not_defaulted(tmp_path: Path) -> None:
    # rope_theta 5000 in config.json: loading it as our default 10000 would change every logit.
    folder = _save(tmp_path / "m")
    cfg, ours = _ours(folder)
    wrong = Transformer(cfg.model_copy(update={"rope_theta": 10000.0}))
    wrong.load_state_dict(ours.state_dict())
    ids = torch.tensor([check_prompt(cfg.vocab_size, cfg.seq_len)])
    with torch.no_grad():
        assert (wrong.eval()(ids)[0] - ours(ids)[0]).abs().max() > 1e-2


def test_a_slice_reads_the_same_values_as_the_whole_tensor(llama: Path) -> None:
    cfg = ModelConfig(**read_hf_config(str(llama)).fields, seq_len=16)
    whole = load_hf_state(str(llama), cfg, names=["blocks.0.attn.wo.weight", "tok_emb.weight"])
    parts = {"blocks.0.attn.wo.weight": (slice(None), slice(16, 32)), "tok_emb.weight": (slice(48, 96), slice(None))}
    sliced = load_hf_state(str(llama), cfg, names=list(parts), parts=parts)
    for name, part in parts.items():
        assert torch.equal(sliced[name], whole[name][part]), name


def test_every_parameter_name_maps_to_hugging_face_and_back() -> None:
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, ffn_hidden=64, vocab_size=96, seq_len=16,
                      moe={"n_experts": 3, "top_k": 2})  # fmt: skip
    dense = cfg.model_copy(update={"moe": None})
    for model in (cfg, dense):
        for name, _ in Transformer(model).named_parameters():
            theirs = hf_name(name)
            assert theirs is not None and our_name(theirs) == name
    assert our_name("model.layers.1.self_attn.k_proj.weight") == "blocks.1.attn.wk.weight"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 16}, "head_dim"),
        ({"auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}, "auto_map"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_what_the_payload_cannot_represent_is_refused_naming_the_field(
    tmp_path: Path, override: dict[str, Any], field: str
) -> None:
    folder = _save(tmp_path / "m", **override)
    with pytest.raises(HFLoadError) as caught:
        read_hf_config(str(folder))
    assert caught.value.field == field and field in str(caught.value)


def test_a_folder_with_pickle_weights_only_is_refused_safetensors_only(tmp_path: Path, llama: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((llama / "config.json").read_text())
    torch.save({"model.embed_tokens.weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(HFLoadError, match="safetensors only") as caught:
        read_hf_config(str(folder))
    assert "pytorch_model.bin" in str(caught.value)


def test_weights_the_model_has_no_place_for_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _save(tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = ModelConfig(**read_hf_config(str(folder)).fields, seq_len=16)
    with pytest.raises(HFLoadError, match="q_proj.bias"):
        load_hf_state(str(folder), cfg)


def _spec(model: dict[str, Any]) -> dict[str, Any]:
    spec = deep_merge(TINY_SPEC, {"data": {"dataset_url": "/data"}, "checkpoint": {"url": "/ckpt"},
                                  "run": {"output_url": "/out"}})  # fmt: skip
    spec["model"] = model
    return spec


def test_a_spec_with_init_from_takes_the_architecture_it_leaves_out_from_config_json(llama: Path) -> None:
    spec = parse_spec(_spec({"init_from": str(llama), "seq_len": 16}))
    m = spec.model
    assert (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_hidden, m.vocab_size) == (2, 32, 4, 2, 64, 96)
    assert (m.rope_theta, m.norm_eps, m.seq_len, m.init_from) == (5000.0, 1e-6, 16, str(llama))


def test_a_spec_field_that_disagrees_with_config_json_is_refused_with_both_values(llama: Path) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec({"init_from": str(llama), "n_heads": 8, "rope_theta": 10000.0, "seq_len": 64}))
    problems = "\n".join(caught.value.problems)
    assert "model.n_heads=8: disagrees with config.json's num_attention_heads=4" in problems
    assert "model.rope_theta=10000.0: disagrees with config.json's rope_theta=5000.0" in problems
    assert "model.seq_len=64: longer than config.json's max_position_embeddings=32" in problems


def test_a_spec_starting_from_an_unsupported_architecture_is_refused_at_parse(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", hidden_act="gelu_new")
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec({"init_from": str(folder)}))
    assert f"model.init_from={folder}: hidden_act=gelu_new: the payload's SwiGLU MLP uses silu" in str(caught.value)
    data, problems = fill_model(_spec({"init_from": str(folder), "n_layers": 2}))
    assert len(problems) == 1 and data["model"] == {"init_from": str(folder), "n_layers": 2}, "nothing filled"


def test_the_init_check_record_round_trips_and_a_damaged_one_is_refused(tmp_path: Path) -> None:
    logits = torch.randn(4, 96)
    url = str(tmp_path / "out" / "init_check.json")
    write_init_check(url, InitCheck("/models/x", [1, 2, 3, 4], logits, "5.0"))
    back = read_init_check(url)
    assert back.prompt_ids == [1, 2, 3, 4] and torch.equal(back.logits, logits) and back.source == "/models/x"
    Path(url).write_text(json.dumps({"format_version": 1, "prompt_ids": [1], "shape": [1, 2]}))
    with pytest.raises(ValueError, match="not an init check record"):
        read_init_check(url)


def test_a_folder_on_an_object_store_is_read_by_byte_ranges_to_the_same_values(llama: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for file in llama.iterdir():
        fs.pipe(f"/hf-store/{file.name}", file.read_bytes())
    try:
        cfg = ModelConfig(**read_hf_config("memory://hf-store").fields, seq_len=16)
        parts = {"blocks.1.mlp.w2.weight": (slice(None), slice(32, 64))}
        remote = load_hf_state("memory://hf-store", cfg, names=["blocks.1.mlp.w2.weight"], parts=parts)
        local = load_hf_state(str(llama), cfg, names=["blocks.1.mlp.w2.weight"], parts=parts)
        assert torch.equal(remote["blocks.1.mlp.w2.weight"], local["blocks.1.mlp.w2.weight"])
    finally:
        fs.rm("/hf-store", recursive=True)


def test_transformers_logits_of_a_folder_on_an_object_store_are_those_of_the_local_copy(llama: Path) -> None:
    import fsspec

    from tasks.init_from import transformers_logits
    from training.storage import StorageConfig

    fs = fsspec.filesystem("memory")
    for file in llama.iterdir():
        fs.pipe(f"/hf-remote/{file.name}", file.read_bytes())
    try:
        prompt = check_prompt(96, 16)
        remote, _ = transformers_logits("memory://hf-remote", prompt, StorageConfig())
        local, _ = transformers_logits(str(llama), prompt, StorageConfig())
        assert remote.shape == (16, 96) and torch.equal(remote, local)
    finally:
        fs.rm("/hf-remote", recursive=True)
