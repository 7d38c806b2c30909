"""Parameter counts: published figures reproduced, and exactly the payload model's count."""

from __future__ import annotations

import pytest
import torch

from tasks.capacity.params import PRESETS, Architecture, count_params
from training.config import ModelConfig, MoEConfig
from training.model import Transformer


def test_llama_3_1_8b_has_8_030_261_248_parameters() -> None:
    assert count_params(PRESETS["llama-3.1-8b"]).total == 8_030_261_248


def test_llama_2_7b_has_6_738_415_616_parameters() -> None:
    assert count_params(PRESETS["llama-2-7b"]).total == 6_738_415_616


def test_gpt3_counts_about_175_billion_parameters() -> None:
    assert 174e9 < count_params(PRESETS["gpt3-175b"]).total < 176e9


def test_mixtral_counts_46_7_billion_parameters_of_which_12_9_billion_active() -> None:
    pc = count_params(PRESETS["mixtral-8x7b"])
    assert round(pc.total / 1e9, 1) == 46.7
    assert round(pc.active_per_token / 1e9, 1) == 12.9


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": None},
        {"mlp": "gelu", "ffn_hidden": 256},
        {"tie_embeddings": True},
        {"moe": MoEConfig(n_experts=4, top_k=2)},
        {"moe": MoEConfig(n_experts=3, top_k=1), "mlp": "gelu", "tie_embeddings": True},
    ],
)
def test_count_matches_the_payload_models_own_count(overrides: dict) -> None:
    cfg = ModelConfig(
        **{
            "n_layers": 3,
            "d_model": 64,
            "n_heads": 8,
            "n_kv_heads": 2,
            "ffn_hidden": 172,
            "vocab_size": 257,
            "seq_len": 32,
            **overrides,
        }
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    assert count_params(Architecture.from_model_config(cfg)).total == model.num_params()


def test_biases_layernorm_and_learned_positions_are_counted() -> None:
    plain = Architecture(n_layers=2, d_model=8, n_heads=2, ffn_hidden=32, vocab_size=10, seq_len=4, mlp="gelu")
    gpt2 = Architecture(
        n_layers=2, d_model=8, n_heads=2, ffn_hidden=32, vocab_size=10, seq_len=4, mlp="gelu",
        norm="layernorm", bias=True, positions="learned",
    )  # fmt: skip
    # per block: qkv+o biases 4h, MLP biases f + h, LayerNorm biases 2h; final norm bias h; positions s*h; head bias V.
    h, f, s, v = 8, 32, 4, 10
    extra = 2 * (4 * h + f + h + 2 * h) + h + s * h + v
    assert count_params(gpt2).total - count_params(plain).total == extra
