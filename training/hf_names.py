"""Our parameter names (training/model.py) and the Hugging Face Llama / Mixtral ones: one table, both directions.

The export (tasks/export/hf.py) writes our tensors under `hf_name`; `model.init_from` (training/hf_load.py) and
the export's load-back check read theirs back under `our_name`. Mixtral's experts keep the per-expert names
`block_sparse_moe.experts.<e>.w1/w2/w3` that transformers and vLLM both read.
"""

from __future__ import annotations

import re

_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(ours), theirs)
    for ours, theirs in (
        (r"tok_emb\.weight", "model.embed_tokens.weight"),
        (r"norm\.weight", "model.norm.weight"),
        (r"lm_head\.weight", "lm_head.weight"),
        (r"blocks\.(\d+)\.attn\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
        (r"blocks\.(\d+)\.attn\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
        (r"blocks\.(\d+)\.attn\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
        (r"blocks\.(\d+)\.attn\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
        (r"blocks\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
        (r"blocks\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (r"blocks\.(\d+)\.mlp\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
        (r"blocks\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.block_sparse_moe.gate.weight"),
        (
            r"blocks\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight",
            r"model.layers.\1.block_sparse_moe.experts.\2.\3.weight",
        ),
    )
)
"""(pattern of our name, its Hugging Face name as a substitution); every group of a pattern appears in its
substitution in order, which is what makes the table invertible (`_REVERSE`)."""


_GROUP = re.compile(r"\(([^()]*)\)")
_BACKREF = re.compile(r"\\(\d+)")


def _reverse(table: tuple[tuple[re.Pattern[str], str], ...]) -> tuple[tuple[re.Pattern[str], str], ...]:
    """The inverse of a name table: each substitution made a pattern (its back-references matching what the
    groups of ours matched), each pattern of ours a substitution."""
    inverse = []
    for pattern, theirs in table:
        groups = _GROUP.findall(pattern.pattern)
        parts = _BACKREF.split(theirs)  # literal, group number, literal, ...
        their_pattern = "".join(
            re.escape(part) if i % 2 == 0 else f"({groups[int(part) - 1]})" for i, part in enumerate(parts)
        )
        count = iter(range(1, len(groups) + 1))
        ours = _GROUP.sub(lambda _m: f"\\{next(count)}", pattern.pattern).replace("\\.", ".")
        inverse.append((re.compile(their_pattern), ours))
    return tuple(inverse)


_REVERSE = _reverse(_NAMES)
"""Hugging Face name -> ours, built once from `_NAMES` at import: a fault that patches `_NAMES` for the export
(a swapped k_proj / v_proj) is then found by the load-back check, which maps the written names back with this."""


class UnknownName(ValueError):
    """A tensor name the table does not map; `name` is the name and `side` says whose name it was."""

    def __init__(self, name: str, side: str) -> None:
        super().__init__(f"{name}: not a {side} parameter name of training/model.py's Transformer")
        self.name, self.side = name, side


def hf_name(name: str, tied: bool = False) -> str | None:
    """The Hugging Face name of our parameter `name`; None for lm_head.weight when tied to the embedding."""
    if tied and name == "lm_head.weight":
        return None
    for pattern, theirs in _NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(theirs, name)
    raise UnknownName(name, "our")


def our_name(name: str) -> str:
    """Our parameter name of the Hugging Face tensor `name` (UnknownName when training/model.py has none)."""
    for pattern, ours in _REVERSE:
        if pattern.fullmatch(name):
            return pattern.sub(ours, name)
    raise UnknownName(name, "Hugging Face Llama / Mixtral")
