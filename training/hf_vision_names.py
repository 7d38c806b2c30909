"""The ONE name table between training/vision.py's VisionTransformer and Hugging Face's vision towers.

Two tables, relative to the encoder (our names without a `vision.` prefix, theirs without the model's prefix):
`VIT` for a ViTModel (inside ViTForImageClassification under `vit.`), `SIGLIP` for a SiglipVisionModel's
vision transformer (saved under `vision_model.`, inside LLaVA as `vision_tower.`). `{i}` is a block index, `{p}`
weight or bias. The exporters (tasks/export/vit.py, tasks/export/vlm.py) prefix them for the files they write;
`model.vision.init_from` (training/hf_vision_load.py) reads a tower through the same tables, so a name fixed here
is fixed both ways.

Shapes agree except SigLIP's position embedding: an nn.Embedding weight (n_tokens, d) where ours is (1, n_tokens, d).
"""

from __future__ import annotations

import re

VIT: tuple[tuple[str, str], ...] = (
    ("patch_embed.{p}", "embeddings.patch_embeddings.projection.{p}"),
    ("cls_token", "embeddings.cls_token"),
    ("pos_emb", "embeddings.position_embeddings"),
    ("blocks.{i}.attn_norm.{p}", "encoder.layer.{i}.layernorm_before.{p}"),
    ("blocks.{i}.attn.wq.{p}", "encoder.layer.{i}.attention.attention.query.{p}"),
    ("blocks.{i}.attn.wk.{p}", "encoder.layer.{i}.attention.attention.key.{p}"),
    ("blocks.{i}.attn.wv.{p}", "encoder.layer.{i}.attention.attention.value.{p}"),
    ("blocks.{i}.attn.wo.{p}", "encoder.layer.{i}.attention.output.dense.{p}"),
    ("blocks.{i}.mlp_norm.{p}", "encoder.layer.{i}.layernorm_after.{p}"),
    ("blocks.{i}.mlp.w1.{p}", "encoder.layer.{i}.intermediate.dense.{p}"),
    ("blocks.{i}.mlp.w2.{p}", "encoder.layer.{i}.output.dense.{p}"),
    ("norm.{p}", "layernorm.{p}"),
)
"""Our VisionTransformer (pooling cls) against ViTModel."""

VIT_HEAD: tuple[tuple[str, str], ...] = (("head.{p}", "classifier.{p}"),)
"""The classifier of a ViTForImageClassification (beside its `vit.` model)."""

SIGLIP: tuple[tuple[str, str], ...] = (
    ("patch_embed.{p}", "embeddings.patch_embedding.{p}"),
    ("pos_emb", "embeddings.position_embedding.weight"),
    ("blocks.{i}.attn_norm.{p}", "encoder.layers.{i}.layer_norm1.{p}"),
    ("blocks.{i}.attn.wq.{p}", "encoder.layers.{i}.self_attn.q_proj.{p}"),
    ("blocks.{i}.attn.wk.{p}", "encoder.layers.{i}.self_attn.k_proj.{p}"),
    ("blocks.{i}.attn.wv.{p}", "encoder.layers.{i}.self_attn.v_proj.{p}"),
    ("blocks.{i}.attn.wo.{p}", "encoder.layers.{i}.self_attn.out_proj.{p}"),
    ("blocks.{i}.mlp_norm.{p}", "encoder.layers.{i}.layer_norm2.{p}"),
    ("blocks.{i}.mlp.w1.{p}", "encoder.layers.{i}.mlp.fc1.{p}"),
    ("blocks.{i}.mlp.w2.{p}", "encoder.layers.{i}.mlp.fc2.{p}"),
)
"""Our VisionTransformer (pooling mean, no class token) against SiglipVisionModel's transformer. Its
post_layernorm has no counterpart: the vlm's encoder ends without a norm (LLaVA reads the last hidden state)."""

SIGLIP_POST_NORM = "post_layernorm.{p}"

_FIELDS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)"}


def prefixed(table: tuple[tuple[str, str], ...], ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """`table` with `ours` in front of our names and `theirs` in front of theirs."""
    return tuple((ours + a, theirs + b) for a, b in table)


def pattern(template: str) -> re.Pattern[str]:
    """The regular expression of a table template (`{i}` digits, `{p}` weight or bias)."""
    parts = re.split(r"\{(\w)\}", template)  # literal, field, literal, ...
    return re.compile("".join(re.escape(part) if k % 2 == 0 else _FIELDS[part] for k, part in enumerate(parts)))


def translate(name: str, table: tuple[tuple[str, str], ...], reverse: bool = False) -> str | None:
    """`name` through `table` (ours -> theirs; theirs -> ours with reverse); None when no row matches."""
    for ours, theirs in table:
        source, target = (theirs, ours) if reverse else (ours, theirs)
        match = pattern(source).fullmatch(name)
        if match:
            return target.format(**match.groupdict())
    return None
