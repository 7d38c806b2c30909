"""Decoder-only Transformer: RMSNorm, rotary embeddings, GQA attention, SwiGLU or MoE MLP, residual dropout."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ModelConfig, MoEConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim of x: (B, H, T, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads through scaled_dot_product_attention."""

    def __init__(self, cfg: ModelConfig, recompute_core: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.recompute_core = recompute_core

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/TP query and n_kv_heads/TP KV heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """w2(gelu(w1 x)), the GPT-2 MLP without biases."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_mlp(cfg: ModelConfig) -> nn.Module:
    """The dense MLP the config asks for."""
    return SwiGLU(cfg.d_model, cfg.ffn_hidden) if cfg.mlp == "swiglu" else GeluMLP(cfg.d_model, cfg.ffn_hidden)


class MoE(nn.Module):
    """Top-k routed experts with the Switch Transformer load-balancing loss, optionally with a capacity limit.

    `capacity_factor` (None = dropless) caps each expert at ceil(factor x tokens x top_k / n_experts) of this
    forward's assignments, the first in token order; a dropped assignment contributes zero (the residual
    carries the token) and is counted in `dropped_tokens`. `dispatch` is None for the dense path, where this
    module holds every expert; training/experts.py sets it to an expert-parallel all-to-all.
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.top_k, self.n_experts = moe.top_k, moe.n_experts
        self.capacity_factor = capacity_factor
        self.dropped_tokens = 0  # assignments dropped by the capacity limit since training.experts last took them
        self.dispatch: Callable[[MoE, torch.Tensor, list[int]], torch.Tensor] | None = None
        self.router = nn.Linear(cfg.d_model, moe.n_experts, bias=False)
        # Keyed by global expert id: expert parallelism keeps a rank's own experts under their full-model names.
        self.experts = nn.ModuleDict({str(e): make_mlp(cfg) for e in range(moe.n_experts)})

    def run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts held here, in id order, applied to `rows` grouped by expert (`counts` rows each)."""
        # Experts that got no rows still run on an empty batch so that every parameter takes part in
        # backward (DDP needs no find_unused_parameters, FSDP2 reduces a zero gradient).
        return torch.cat([expert(part) for expert, part in zip(self.experts.values(), rows.split(counts), strict=True)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        # Fraction of routing assignments per expert times its mean probability (Fedus et al. 2021); computed
        # before any drop, from this rank's tokens only.
        assigned = F.one_hot(chosen, self.n_experts).sum(dim=(0, 1)).float() / chosen.numel()
        aux = self.n_experts * (assigned * probs.mean(dim=0)).sum()

        # Assignments sorted by expert; the stable sort keeps token order within each expert.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * tokens.shape[0] * self.top_k / self.n_experts)
            rank_in_expert = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
            order = order[rank_in_expert < capacity]
            kept = counts.clamp(max=capacity)
            # A forward recomputed inside backward (activation checkpointing) was counted the first time.
            if torch._C._current_graph_task_id() == -1:  # noqa: SLF001 - torch has no public "in backward"
                self.dropped_tokens += int((counts - kept).sum())
            counts = kept
        token_idx = order // self.top_k
        rows = tokens[token_idx]
        counts_list = counts.tolist()
        out_rows = (
            self.dispatch(self, rows, counts_list) if self.dispatch is not None else self.run_experts(rows, counts_list)
        )
        contribution = out_rows * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, token_idx, contribution)
        return out.reshape(shape), aux


class Block(nn.Module):
    """Pre-norm Transformer block."""

    def __init__(self, cfg: ModelConfig, recompute_attention: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, recompute_attention)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg, cfg.moe) if cfg.moe else make_mlp(cfg)
        # Residual dropout as in GPT-2/nanoGPT: on each branch's output before it joins the residual stream.
        # It draws from torch's global RNG, so bit-exact resumption needs the checkpoint's per-rank RNG state.
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.mlp_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn_dropout(self.attn(self.attn_norm(x), cos, sin))
        mlp_out = self.mlp(self.mlp_norm(x))
        if isinstance(mlp_out, tuple):
            mlp_out, aux = mlp_out
        else:
            aux = x.new_zeros((), dtype=torch.float32)
        return x + self.mlp_dropout(mlp_out), aux


class Transformer(nn.Module):
    """The model: embeddings, blocks, final norm, output projection. Returns logits and the MoE aux loss."""

    def __init__(self, cfg: ModelConfig, recompute: str = "none") -> None:
        super().__init__()
        self.cfg = cfg
        self.recompute_blocks = recompute == "full"
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Keyed by layer index: a pipeline stage keeps its layers under their full-model names (blocks.<i>...),
        # so a stage's checkpoint is a part of the whole model's.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, recompute == "selective") for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * n_layers)."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(param, mean=0.0, std=std)
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and aux loss. A pipeline chunk without tok_emb takes hidden states, one without lm_head
        returns them (training/pipeline.py). `prefix` (B, P, d_model): input embeddings put in front of the
        tokens' (a vision-language model's projected image tokens, training/vlm.py); the logits cover both."""
        x = self.tok_emb(idx) if self.tok_emb is not None else idx
        if prefix is not None:
            x = torch.cat([prefix.to(x.dtype), x], dim=1)
        aux_total = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks.values():
            if self.recompute_blocks and torch.is_grad_enabled():
                x, aux = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x, aux = block(x, self.rope_cos, self.rope_sin)
            aux_total = aux_total + aux
        if self.norm is not None:
            x = self.norm(x)
        return (self.lm_head(x) if self.lm_head is not None else x), aux_total

    def num_params(self) -> int:
        """Parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters())


def blocks_of(model: nn.Module) -> Iterator[nn.Module]:
    """The blocks of any of our models in forward order, each once: those of every `blocks` ModuleDict among its
    modules (a Transformer's or pipeline chunk's, a VisionTransformer's, a vision-language model's vision tower's
    then its language model's). The parallel layouts and run.compile wrap them one by one."""
    seen: set[int] = set()
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        if not isinstance(blocks, nn.ModuleDict):
            continue
        for block in blocks.values():
            if id(block) not in seen:
                seen.add(id(block))
                yield block
