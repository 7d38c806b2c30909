"""The Transformer: shapes, grouped-query attention, MoE routing, tying, recompute."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.config import ModelConfig, MoEConfig
from training.experts import set_capacity_factor, take_dropped_tokens
from training.model import MoE, Transformer, apply_rotary, rotary_tables

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


MOE = SMALL.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2)})


def _per_assignment_moe(moe: MoE, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """The MoE written as a loop over tokens and their experts, skipping assignments beyond `capacity`."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.softmax(moe.router(tokens), dim=-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    taken = [0] * moe.n_experts
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros_like(tokens[t])
        for k in range(moe.top_k):
            e = int(chosen[t, k])
            taken[e] += 1
            if capacity is None or taken[e] <= capacity:
                row = row + weights[t, k] * moe.experts[str(e)](tokens[t : t + 1])[0]
        rows.append(row)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("factor", [None, 0.5, 4.0])
def test_moe_capacity_keeps_the_first_assignments_in_token_order_and_counts_the_rest(factor: float | None) -> None:
    torch.manual_seed(0)
    moe = MoE(MOE, MOE.moe, capacity_factor=factor)
    x = torch.randn(2, 8, 32)
    out, _ = moe(x)
    capacity = None if factor is None else math.ceil(factor * 16 * 2 / 4)
    torch.testing.assert_close(out, _per_assignment_moe(moe, x, capacity), rtol=1e-5, atol=1e-6)
    _, chosen = moe.router(x.reshape(-1, 32)).topk(2, dim=-1)
    counts = torch.bincount(chosen.reshape(-1), minlength=4)
    expected = 0 if capacity is None else int((counts - counts.clamp(max=capacity)).sum())
    assert moe.dropped_tokens == expected
    assert (expected > 0) == (factor == 0.5)


def test_take_dropped_tokens_sums_the_layers_and_resets_even_under_full_recompute() -> None:
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    counted = []
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        model = Transformer(MOE, recompute=recompute)
        set_capacity_factor(model, 0.5)
        _loss_and_grads(model, tokens)  # the recomputed forward inside backward is not counted again
        per_layer = [block.mlp.dropped_tokens for block in model.blocks.values()]
        counted.append(take_dropped_tokens(model))
        assert counted[-1] == sum(per_layer) > 0
        assert take_dropped_tokens(model) == 0
    assert counted[0] == counted[1]


def test_moe_expert_without_tokens_gets_a_zero_gradient() -> None:
    torch.manual_seed(0)
    moe = MoE(MOE, MOE.moe)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([1.0, 2.0, 3.0, -1.0]).unsqueeze(1).expand(4, 32))
    out, _ = moe(torch.rand(2, 8, 32) + 0.1)  # positive inputs: experts 2 and 1 win, 3 scores lowest
    out.sum().backward()
    assert torch.count_nonzero(moe.experts["3"].w1.weight.grad) == 0
    assert torch.count_nonzero(moe.experts["2"].w1.weight.grad) > 0
