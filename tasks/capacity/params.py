"""Parameter counts from the architecture: dense and MoE blocks, GQA, SwiGLU or GeLU MLP, embeddings, norms, biases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from training.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    """A decoder-only Transformer, a superset of the payload's `ModelConfig` (biases, LayerNorm, learned positions).

    `norm_impl` and `dropout` only matter for activation memory: `eager` is the payload's Python RMSNorm (saves
    its fp32 input and normalised output), `fused` a fused kernel that saves its input only (Megatron, Apex, TE).
    """

    n_layers: int
    d_model: int
    n_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    n_kv_heads: int | None = None
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_impl: Literal["eager", "fused"] = "eager"
    bias: bool = False
    positions: Literal["rope", "learned"] = "rope"
    tie_embeddings: bool = False
    dropout: bool = False
    n_experts: int | None = None
    top_k: int = 1
    name: str = field(default="model", compare=False)

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are routed experts."""
        return self.n_experts is not None

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str = "model") -> Architecture:
        """The payload's model (training/model.py) as an Architecture."""
        return cls(
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            ffn_hidden=cfg.ffn_hidden,
            vocab_size=cfg.vocab_size,
            seq_len=cfg.seq_len,
            mlp=cfg.mlp,
            tie_embeddings=cfg.tie_embeddings,
            n_experts=cfg.moe.n_experts if cfg.moe else None,
            top_k=cfg.moe.top_k if cfg.moe else 1,
            name=name,
        )


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part; `per_layer_*` are for one block."""

    embedding: int
    positions: int
    per_layer_attention: int
    per_layer_mlp_dense: int
    per_layer_experts: int
    per_layer_router: int
    per_layer_norms: int
    final_norm: int
    head: int
    n_layers: int
    active_expert_fraction: float

    @property
    def per_layer(self) -> int:
        """All parameters of one block."""
        return (
            self.per_layer_attention
            + self.per_layer_mlp_dense
            + self.per_layer_experts
            + self.per_layer_router
            + self.per_layer_norms
        )

    @property
    def total(self) -> int:
        """Every parameter, tied weights once."""
        return self.embedding + self.positions + self.n_layers * self.per_layer + self.final_norm + self.head

    @property
    def experts(self) -> int:
        """Parameters in routed experts (spread by expert parallelism)."""
        return self.n_layers * self.per_layer_experts

    @property
    def active_per_token(self) -> int:
        """Parameters a token passes through (MoE: top_k of n_experts), for FLOPs."""
        per_layer = self.per_layer - self.per_layer_experts + self.per_layer_experts * self.active_expert_fraction
        return int(self.embedding + self.positions + self.n_layers * per_layer + self.final_norm + self.head)

    @property
    def matmul_per_token(self) -> int:
        """Parameters used in matrix multiplies by one token (no embedding lookup, norms or biases' FLOPs aside)."""
        per_layer = self.per_layer - self.per_layer_norms - self.per_layer_experts
        per_layer += self.per_layer_experts * self.active_expert_fraction
        head = self.head if self.head else self.embedding  # tied: the embedding matrix is the output layer
        return int(self.n_layers * per_layer + head)


def count_params(arch: Architecture) -> ParamCount:
    """Exact parameter count of `arch` (matches `Transformer.num_params()` for the payload's model)."""
    h, f, kv = arch.d_model, arch.ffn_hidden, arch.kv_dim
    b = arch.bias
    norm = h * (2 if arch.norm == "layernorm" else 1)
    attention = h * h + 2 * h * kv + h * h + ((h + 2 * kv + h) if b else 0)
    mlp_matrices = 3 if arch.mlp == "swiglu" else 2
    mlp = mlp_matrices * h * f + (((2 if arch.mlp == "swiglu" else 1) * f + h) if b else 0)
    experts = router = 0
    if arch.is_moe:
        assert arch.n_experts is not None
        experts, router, mlp = arch.n_experts * mlp, h * arch.n_experts, 0
    return ParamCount(
        embedding=arch.vocab_size * h,
        positions=arch.seq_len * h if arch.positions == "learned" else 0,
        per_layer_attention=attention,
        per_layer_mlp_dense=mlp,
        per_layer_experts=experts,
        per_layer_router=router,
        per_layer_norms=2 * norm,
        final_norm=norm,
        head=0 if arch.tie_embeddings else arch.vocab_size * h + (arch.vocab_size if b else 0),
        n_layers=arch.n_layers,
        active_expert_fraction=arch.top_k / arch.n_experts if arch.n_experts else 1.0,
    )


PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            name="llama-2-7b", n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, vocab_size=32000, seq_len=4096
        ),
        Architecture(
            name="llama-3.1-8b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            ffn_hidden=14336,
            vocab_size=128256,
            seq_len=8192,
        ),
        Architecture(
            name="llama-3.1-70b",
            n_layers=80,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            ffn_hidden=28672,
            vocab_size=128256,
            seq_len=8192,
        ),
        Architecture(
            name="mixtral-8x7b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            ffn_hidden=14336,
            vocab_size=32000,
            seq_len=4096,
            n_experts=8,
            top_k=2,
        ),
        # Llama 3 405B (Llama Team 2024, Table 3): 126 layers, which its 16 pipeline stages do not divide.
        Architecture(
            name="llama-3.1-405b",
            n_layers=126,
            d_model=16384,
            n_heads=128,
            n_kv_heads=8,
            ffn_hidden=53248,
            vocab_size=128256,
            seq_len=8192,
        ),
        # GPT-3 as trained with Megatron-LM (Narayanan et al. 2021; Korthikanti et al. 2022): LayerNorm, GeLU 4h,
        # biases, learned positions, dropout, fused norms.
        Architecture(
            name="gpt3-175b",
            n_layers=96,
            d_model=12288,
            n_heads=96,
            ffn_hidden=4 * 12288,
            vocab_size=51200,
            seq_len=2048,
            mlp="gelu",
            norm="layernorm",
            norm_impl="fused",
            bias=True,
            positions="learned",
            tie_embeddings=True,
            dropout=True,
        ),
    )
}
