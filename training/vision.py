"""Vision Transformer (Dosovitskiy et al. 2020): patch embedding, a class token or mean pooling, pre-norm LayerNorm
blocks with biased projections and exact GELU, a final LayerNorm and a classifier head.

The module and parameter names are fixed: the exports map them one to one onto Hugging Face's
ViTForImageClassification (pooling cls) and SiglipVisionModel (pooling mean) (tasks/export/vit.py). Pixels arrive
as uint8 and are normalised by the model's first op, (x / 255 - 0.5) / 0.5, which is what those models' image
processors do with mean = std = 0.5, so that a served model and the trained one see the same numbers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import VisionConfig


def normalise_pixels(pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 pixels to (x / 255 - 0.5) / 0.5 in [-1, 1]; a float input is taken as normalised already."""
    if pixels.dtype == torch.uint8:
        return (pixels.to(dtype) / 255.0 - 0.5) / 0.5
    return pixels.to(dtype)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased Q/K/V/output projections, through SDPA."""

    def __init__(self, vcfg: VisionConfig, recompute_core: bool) -> None:
        super().__init__()
        d = vcfg.d_model
        self.head_dim = vcfg.head_dim
        self.wq = nn.Linear(d, d, bias=True)
        self.wk = nn.Linear(d, d, bias=True)
        self.wv = nn.Linear(d, d, bias=True)
        self.wo = nn.Linear(d, d, bias=True)
        self.recompute_core = recompute_core

    @staticmethod
    def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / TP of them (training/tensor_parallel.py).
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class VisionMLP(nn.Module):
    """w2(gelu(w1 x)) with biases and the exact (erf) GELU, as ViT and SigLIP define it."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=True)
        self.w2 = nn.Linear(hidden, d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class VisionBlock(nn.Module):
    """Pre-norm encoder block: x + attn(LN x), then x + mlp(LN x); residual dropout on each branch."""

    def __init__(self, vcfg: VisionConfig, recompute_attention: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(vcfg.d_model, eps=vcfg.norm_eps)
        self.attn = VisionAttention(vcfg, recompute_attention)
        self.mlp_norm = nn.LayerNorm(vcfg.d_model, eps=vcfg.norm_eps)
        self.mlp = VisionMLP(vcfg.d_model, vcfg.ffn_hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.attn_norm(x)))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class VisionTransformer(nn.Module):
    """The encoder and, given `num_classes`, the classifier: `forward` returns logits (B, C), `features` the final
    normed token states (B, n_tokens, d) that a vision-language model projects (training/vlm.py)."""

    def __init__(
        self,
        vcfg: VisionConfig,
        num_classes: int | None,
        recompute: str = "none",
        dropout: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.vcfg = vcfg
        self.init_std = init_std
        self.recompute_blocks = recompute == "full"
        d = vcfg.d_model
        self.patch_embed = nn.Conv2d(vcfg.channels, d, kernel_size=vcfg.patch_size, stride=vcfg.patch_size, bias=True)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if vcfg.pooling == "cls" else None
        self.pos_emb = nn.Parameter(torch.zeros(1, vcfg.n_tokens, d))
        self.blocks = nn.ModuleDict(
            {str(i): VisionBlock(vcfg, recompute == "selective", dropout) for i in range(vcfg.n_layers)}
        )
        self.norm = nn.LayerNorm(d, eps=vcfg.norm_eps)
        self.head = nn.Linear(d, num_classes, bias=True) if num_classes is not None else None
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) matrices, position embedding and class token; residual output projections scaled by
        1/sqrt(2 * n_layers); zero biases, LayerNorm weights one."""
        std = self.init_std
        residual_std = std / math.sqrt(2 * self.vcfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 1:
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(param, mean=0.0, std=std)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) uint8 (or normalised float) pixels to the final LayerNorm's token states (B, n_tokens, d):
        the class token first under pooling cls, then the patches in row-major order."""
        x = normalise_pixels(pixels, self.patch_embed.weight.dtype)
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, patches, d)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_emb
        for block in self.blocks.values():
            if self.recompute_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.norm(x)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Class logits (B, num_classes): the head on the class token (pooling cls) or the patches' mean (mean)."""
        if self.head is None:
            raise ValueError("this VisionTransformer has no classifier head (num_classes=None); call features()")
        x = self.features(pixels)
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)
        return self.head(pooled)

    def num_params(self) -> int:
        """Parameters."""
        return sum(p.numel() for p in self.parameters())
