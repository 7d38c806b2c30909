"""The Transformer: shapes, grouped-query attention, MoE routing, tying, recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.config import ModelConfig, MoEConfig
from training.model import Transformer, apply_rotary, rotary_tables

SMALL = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=97, seq_len=16)


def _loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits, aux = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)) + 0.01 * aux
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_forward_gives_logits_for_every_position() -> None:
    torch.manual_seed(0)
    logits, aux = Transformer(SMALL)(torch.randint(0, 97, (3, 16)))
    assert logits.shape == (3, 16, 97) and aux.item() == 0.0


def test_grouped_query_attention_has_fewer_kv_parameters() -> None:
    model = Transformer(SMALL)
    attn = model.blocks["0"].attn
    assert attn.wq.weight.shape == (32, 32)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (16, 32)  # 2 kv heads of width 8


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    tokens = torch.randint(0, 97, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 97
    with torch.no_grad():
        a, _ = model(tokens)
        b, _ = model(changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_rotary_preserves_norm_and_encodes_relative_position() -> None:
    cos, sin = rotary_tables(8, 16, 10000.0)
    q, k = torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    rq, rk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    same_q, same_k = q[:, :, :1].expand_as(q), k[:, :, :1].expand_as(k)
    rq, rk = apply_rotary(same_q, cos, sin), apply_rotary(same_k, cos, sin)
    # the score of positions (i, j) depends only on i - j
    assert torch.allclose((rq[..., 5, :] * rk[..., 3, :]).sum(), (rq[..., 9, :] * rk[..., 7, :]).sum(), atol=1e-5)


def test_tied_embeddings_share_one_matrix() -> None:
    untied = Transformer(SMALL)
    tied = Transformer(SMALL.model_copy(update={"tie_embeddings": True}))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 97 * 32


def test_moe_routes_top2_and_returns_a_balancing_loss() -> None:
    torch.manual_seed(0)
    cfg = SMALL.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2)})
    model = Transformer(cfg)
    assert len(model.blocks["0"].mlp.experts) == 4
    tokens = torch.randint(0, 97, (4, 17))
    loss, grads = _loss_and_grads(model, tokens)
    _, aux = model(tokens[:, :-1])
    # Switch loss is n_experts * sum(f_e * P_e): 1.0 when perfectly balanced, higher otherwise
    assert 0.9 < aux.item() / cfg.n_layers < 4.0
    assert all(g is not None for g in grads.values())  # every expert's weights get a gradient
    assert grads["blocks.0.mlp.router.weight"].abs().sum() > 0


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_recompute_gives_the_same_gradients(mode: str) -> None:
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = Transformer(SMALL)
    torch.manual_seed(0)
    recomputed = Transformer(SMALL, recompute=mode)
    loss_a, grads_a = _loss_and_grads(plain, tokens)
    loss_b, grads_b = _loss_and_grads(recomputed, tokens)
    assert loss_a == loss_b
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], atol=1e-6), name


def test_gelu_mlp_variant_builds_and_trains() -> None:
    model = Transformer(SMALL.model_copy(update={"mlp": "gelu"}))
    loss, grads = _loss_and_grads(model, torch.randint(0, 97, (2, 17)))
    assert loss > 0 and "blocks.0.mlp.w1.weight" in grads and "blocks.0.mlp.w3.weight" not in grads
