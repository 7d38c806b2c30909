"""Parameter counts from the architecture: dense and MoE blocks, GQA, SwiGLU or GeLU MLP, embeddings, norms, biases.

A Vision Transformer (model.kind vit, training/vision.py) is the same stack over image tokens: its sequence is the
patches plus the class token, its "embedding" the patch embedding (a biased linear map of channels x patch^2 pixel
values, the Conv2d) and the class token, its positions learned, its blocks LayerNorm + biased projections + GeLU,
and its output layer the classifier, which reads one token per image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from training.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    """A decoder-only Transformer, a superset of the payload's `ModelConfig` (biases, LayerNorm, learned positions).

    `norm_impl` and `dropout` only matter for activation memory: `eager` is the payload's Python RMSNorm (saves
    its fp32 input and normalised output), `fused` a fused kernel that saves its input only (Megatron, Apex, TE),
    `native` torch's nn.LayerNorm (the ViT's: its input and an fp32 mean and rstd per token; autocast runs it in
    fp32, so each linear after it keeps its own 16-bit copy of the output).
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
    norm_impl: Literal["eager", "fused", "native"] = "eager"
    bias: bool = False
    positions: Literal["rope", "learned"] = "rope"
    tie_embeddings: bool = False
    dropout: bool = False
    n_experts: int | None = None
    top_k: int = 1
    patch_inputs: int | None = None
    """A vision encoder: pixel values one patch token embeds (channels x patch_size^2); None: a token embedding."""
    class_token: bool = False
    """A vision encoder with a learned class token (pooling cls) in front of the patches."""
    encoder: Architecture | None = None
    """A vision-language model (kind vlm): its vision encoder, a ViT over the image's patches without a head or a
    final norm, whose patch tokens the projector maps into this language model's first `encoder.seq_len` positions."""
    projector_hidden: int = 0
    """A vision-language model: the projector's hidden width (linear, GELU, linear, with biases, as LLaVA's)."""
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
    def is_vision(self) -> bool:
        """Whether the inputs are image patches (a ViT classifier: one output row per image, not per token)."""
        return self.patch_inputs is not None

    @property
    def patches(self) -> int:
        """Patch tokens of a sequence (an image): all but the class token; every token for a language model."""
        return self.seq_len - (1 if self.class_token else 0)

    @property
    def output_rows_per_sequence(self) -> int:
        """Rows of logits a sequence gives the loss: every token's for a language model, one per image for a
        classifier (the class token's or the patches' mean)."""
        return 1 if self.is_vision else self.seq_len

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are routed experts."""
        return self.n_experts is not None

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str = "model") -> Architecture:
        """The payload's model (training/model.py; a ViT classifier of training/vision.py for kind vit) as an
        Architecture. A vlm is its language model over image and caption tokens with the encoder and projector
        of training/vlm.py (`encoder`, `projector_hidden`)."""
        if cfg.kind == "vit":
            vision = cfg.vision
            assert vision is not None and vision.num_classes is not None, "ModelConfig validates kind vit"
            return cls(
                n_layers=vision.n_layers,
                d_model=vision.d_model,
                n_heads=vision.n_heads,
                ffn_hidden=vision.ffn_hidden,
                vocab_size=vision.num_classes,
                seq_len=vision.n_tokens,
                mlp="gelu",
                norm="layernorm",
                norm_impl="native",  # torch's nn.LayerNorm: keeps its input and the per-token mean and rstd
                bias=True,
                positions="learned",
                dropout=cfg.dropout > 0,
                patch_inputs=vision.channels * vision.patch_size**2,
                class_token=vision.pooling == "cls",
                name=name,
            )
        encoder, projector_hidden = None, 0
        if cfg.kind == "vlm":
            vision = cfg.vision
            assert vision is not None, "ModelConfig validates kind vlm"
            encoder = cls(
                n_layers=vision.n_layers, d_model=vision.d_model, n_heads=vision.n_heads, ffn_hidden=vision.ffn_hidden,
                vocab_size=0, seq_len=vision.n_tokens, mlp="gelu", norm="layernorm", norm_impl="native", bias=True,
                positions="learned", dropout=cfg.dropout > 0, patch_inputs=vision.channels * vision.patch_size**2,
                class_token=vision.pooling == "cls", name=f"{name} encoder",
            )  # fmt: skip
            projector_hidden = vision.projector_hidden or cfg.d_model
        return cls(
            encoder=encoder,
            projector_hidden=projector_hidden,
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
    encoder: int = 0
    """A vision-language model: the vision encoder's and the projector's parameters."""

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
        return (
            self.embedding + self.positions + self.n_layers * self.per_layer + self.final_norm + self.head
            + self.encoder
        )  # fmt: skip

    @property
    def experts(self) -> int:
        """Parameters in routed experts (spread by expert parallelism)."""
        return self.n_layers * self.per_layer_experts

    @property
    def active_per_token(self) -> int:
        """Parameters a token passes through (MoE: top_k of n_experts), for FLOPs."""
        per_layer = self.per_layer - self.per_layer_experts + self.per_layer_experts * self.active_expert_fraction
        return int(
            self.embedding + self.positions + self.n_layers * per_layer + self.final_norm + self.head + self.encoder
        )

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
    if arch.patch_inputs is not None:
        embedding = arch.patch_inputs * h + h + (h if arch.class_token else 0)  # Conv2d weight and bias, class token
    else:
        embedding = arch.vocab_size * h
    encoder = 0
    if arch.encoder is not None:
        vision = count_params(arch.encoder)
        d, p = arch.encoder.d_model, arch.projector_hidden
        # training/vlm.py drops the encoder's final norm (LLaVA reads the last block's output); the projector
        encoder = vision.total - vision.final_norm + d * p + p + p * h + h
    return ParamCount(
        embedding=embedding,
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
        encoder=encoder,
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
