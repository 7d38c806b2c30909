"""Typed configuration of the training payload.

`TrainConfig` is the training layer's own slice of a deployment spec. It crosses
to the cluster as JSON (`run.json`) and is read back by the same class, so the
validation that ran on the operator's machine runs again on every node.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from training.secrets import REDACTED, is_credential_name, redact, redact_text
from training.storage import StorageConfig, StorageUrl
from training.untrusted import escape_untrusted

# Upper bounds of the counts: far beyond any real run, low enough that every loop and product over them stays cheap.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 18  # d_model, ffn_hidden
MAX_HEADS = 1024
MAX_VOCAB = 1 << 22
MAX_SEQ_LEN = 1 << 20
MAX_IMAGE_PX = 1 << 14  # side of a square input image
MAX_EXPERTS = 1024
MAX_RANKS = 1 << 20  # processes of one job
MAX_BATCH = 1 << 16  # micro-batch, accumulation steps, evaluation batches
MAX_STEPS = 10**9
MAX_SEED = 2**32 - 1  # numpy's legacy seeding takes 32 bits
MAX_COMM_PROBE_MB = 1024.0  # one start-up probe message
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class StrictModel(BaseModel):
    """Base for every config model: unknown fields are errors, defaults are validated, no Inf or NaN floats."""

    model_config = ConfigDict(extra="forbid", validate_default=True, validate_assignment=True, allow_inf_nan=False)


Problem = tuple[tuple[str | int, ...], Any, str]
"""A cross-field problem: (location, offending value, message that says the fix)."""


def raise_problems(title: str, problems: list[Problem]) -> None:
    """Raise one ValidationError carrying every problem, so users see them all at once."""
    if not problems:
        return
    raise ValidationError.from_exception_data(
        title,
        [
            {"type": PydanticCustomError("spec", message), "loc": loc, "input": value}
            for loc, value, message in problems
        ],
    )


def _describe_constraint(err: dict[str, Any]) -> str:
    ctx = err.get("ctx") or {}
    kind = err["type"]
    operators = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in operators:
        op, key = operators[kind]
        return f"must be {op} {ctx[key]}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind == "missing":
        return "is required; add it to the spec"
    if kind == "extra_forbidden":
        return "is not a known field; remove it or check its spelling"
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx.get('pattern')}"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    if kind == "finite_number":
        return "must be a finite number (not Inf or NaN)"
    return err["msg"]


def _shown(loc: tuple[str | int, ...], value: Any, limit: int = 200) -> str:
    """The offending value as the message shows it: credentials redacted, containers elided, long ones cut."""
    if any(is_credential_name(part) for part in loc):
        return REDACTED
    if isinstance(value, dict):
        return "{...}"
    if isinstance(value, str):  # cut first: a megabyte in a wrongly typed field costs what its first line costs
        cut = len(value) > limit
        head = redact_text(value[:limit], cut=cut)
        plain = value == "" or value.strip(" \t") == value
        shown = head if plain else json.dumps(head)  # a blank or padded string shows its quotes
        shown = escape_untrusted(shown, limit=None)  # a NUL, a newline or a terminal escape shows escaped
        return f"{shown}... ({len(value)} characters)" if cut else shown
    shown = json.dumps(redact(value), default=str)
    shown = _CONTROL.sub(lambda m: repr(m.group())[1:-1], shown)  # a NUL or a newline shows escaped
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} characters)"


def format_validation_error(error: ValidationError, removed: dict[str, str] | None = None) -> list[str]:
    """Render a pydantic error as `field.path=value: what is wrong and the fix` lines; `removed` maps a field that
    existed once (`data.bootstrap`) to what replaced it, said instead of "not a known field"."""
    lines = []
    for err in error.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "<spec>"
        message = _describe_constraint(err)
        if err["type"] == "extra_forbidden" and removed and loc in removed:
            message = f"was removed; {removed[loc]}"
        if err["type"] == "missing":
            lines.append(f"{loc}: {message}")
        else:
            lines.append(f"{loc}={_shown(err['loc'], err.get('input'))}: {message}")
    return lines


def first_problem(error: ValidationError, root: str = "<file>") -> str:
    """`N problem(s), first: field.path: message`: how a refused untrusted file (manifest, model card, ledger
    entry, baseline) says what is wrong with it without echoing its content."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or root
    return f"{error.error_count()} problem(s), first: {where}: {first['msg']}"


def divisors(n: int) -> list[int]:
    """Every divisor of n >= 1, ascending, in O(sqrt n) steps."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


class MoEConfig(StrictModel):
    """Mixture-of-Experts MLP: every block's MLP becomes a routed set of experts."""

    n_experts: int = Field(ge=2, le=MAX_EXPERTS, description="Number of experts per MoE layer.")
    top_k: int = Field(default=2, ge=1, le=MAX_EXPERTS, description="Experts each token is routed to.")
    aux_loss_coef: float = Field(
        default=0.01, ge=0, le=100, description="Weight of the Switch-style load-balancing loss."
    )

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise_problems(
                "MoEConfig",
                [(("top_k",), self.top_k, f"must be <= n_experts={self.n_experts}")],
            )
        return self


class VisionConfig(StrictModel):
    """The vision encoder (training/vision.py): a ViT of patch embedding, pre-norm LayerNorm blocks with biased
    projections and exact GELU, a final LayerNorm; Hugging Face ViT-shaped with a class token (pooling cls) or
    SigLIP-shaped without one (pooling mean)."""

    image_size: int = Field(ge=1, le=MAX_IMAGE_PX, description="Side of the square input images in pixels.")
    patch_size: int = Field(
        ge=1, le=MAX_IMAGE_PX, description="Side of a square patch in pixels (one image token); divides image_size."
    )
    channels: int = Field(default=3, ge=1, le=4, description="Colour channels of the input images (3: RGB).")
    n_layers: int = Field(ge=1, le=MAX_LAYERS, description="Number of encoder blocks.")
    d_model: int = Field(ge=1, le=MAX_WIDTH, description="Hidden size of the encoder.")
    n_heads: int = Field(ge=1, le=MAX_HEADS, description="Attention heads of the encoder; divides d_model.")
    ffn_hidden: int = Field(ge=1, le=MAX_WIDTH, description="Hidden size of the encoder's MLP.")
    norm_eps: float = Field(default=1e-6, gt=0, le=1, description="LayerNorm epsilon of the encoder.")
    pooling: Literal["cls", "mean"] = Field(
        default="cls",
        description="cls: a learned class token in front of the patches, the classifier reads its final state "
        "(Hugging Face ViT); mean: no class token, the classifier reads the mean of the patch tokens (SigLIP-shaped, "
        "what model.kind=vlm uses).",
    )
    num_classes: int | None = Field(
        default=None,
        ge=2,
        le=MAX_VOCAB,
        description="Classes of the classifier head (model.kind=vit: required, must equal the image dataset's "
        "num_classes); None for vlm (no head).",
    )
    projector_hidden: int | None = Field(
        default=None,
        ge=1,
        le=MAX_WIDTH,
        description="model.kind=vlm: hidden size of the projector from the encoder to the language model "
        "(linear, GELU, linear, as LLaVA's); None = the language model's d_model. Not used by vit.",
    )
    init_from: StorageUrl | None = Field(
        default=None,
        description="Start the encoder from this Hugging Face vision tower (a local folder or fsspec URL holding "
        "config.json and *.safetensors; pickle weights are refused): a ViTModel or ViTForImageClassification for "
        "kind vit (pooling cls; the classifier head is loaded only when the checkpoint's has num_classes rows, "
        "else it starts random), a SiglipVisionModel for kind vlm (pooling mean; its post_layernorm and pooling "
        "head are not used). Every architecture field above must agree with its config.json (image_size, "
        "patch_size, channels, n_layers, d_model, n_heads, ffn_hidden, norm_eps, an exact-GELU hidden_act); a "
        "disagreement refuses the start naming both values (training/hf_vision_load.py). Only a fresh start "
        "loads it; a resumed run continues from its own checkpoint. None = random initialisation.",
    )

    @property
    def num_patches(self) -> int:
        """Image tokens of the patch grid: (image_size / patch_size)^2."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_tokens(self) -> int:
        """Tokens the encoder runs on: the patches, plus the class token under pooling cls."""
        return self.num_patches + (1 if self.pooling == "cls" else 0)

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.d_model // self.n_heads

    @model_validator(mode="after")
    def _shapes_agree(self) -> VisionConfig:
        problems: list[Problem] = []
        if self.image_size % self.patch_size:
            ok = [d for d in divisors(self.image_size) if d < self.image_size]
            problems.append(
                (("patch_size",), self.patch_size, f"must divide image_size={self.image_size}; use one of {ok[-6:]}")
            )
        if self.d_model % self.n_heads:
            valid = [h for h in divisors(self.d_model) if h <= 128]
            problems.append(
                (("n_heads",), self.n_heads, f"must divide d_model={self.d_model}; use one of {valid[-6:]}")
            )
        raise_problems("VisionConfig", problems)
        return self


# The top-level text fields a vit spec may leave out: filled in from model.vision (see ModelConfig's description).
_VIT_MIRRORED = ("n_layers", "d_model", "n_heads", "ffn_hidden", "vocab_size", "seq_len")


def _vit_value(vision: VisionConfig, name: str) -> int:
    """What a vit's top-level `name` is: the encoder's own figure, its classes (vocab_size), its tokens (seq_len)."""
    if name == "vocab_size":
        return vision.num_classes or 2
    if name == "seq_len":
        return vision.n_tokens
    return int(getattr(vision, name))


class ModelConfig(StrictModel):
    """The model: a decoder-only Transformer (kind lm), a Vision Transformer classifier (kind vit, the encoder in
    `vision`), or a vision-language model (kind vlm: the encoder in `vision`, a projector, and this Transformer).

    For kind vit the text fields n_layers, d_model, n_heads, ffn_hidden, vocab_size and seq_len are not read by
    the model: a spec may leave them out and they are filled in from `vision` (vocab_size = vision.num_classes,
    seq_len = vision's tokens per image), so that everything that counts layers, widths and tokens per sample (the
    planner, throughput records) sees the encoder; stated, they must agree with it. mlp, norm_eps and rope_theta are
    not read for vit (the encoder's are vision.norm_eps and the exact GELU; positions are learned); dropout and
    init_std apply to the encoder as to the language model.
    """

    kind: Literal["lm", "vit", "vlm"] = Field(
        default="lm",
        description="lm: decoder-only language model on token datasets; vit: image classifier on a labelled image "
        "dataset (model.vision, training/vision.py); vlm: image captioning, vision encoder + projector + this "
        "language model on an image-caption dataset (training/vlm.py).",
    )
    vision: VisionConfig | None = Field(
        default=None, description="The vision encoder: required for kind vit and vlm, refused for lm."
    )
    n_layers: int = Field(ge=1, le=MAX_LAYERS, description="Number of Transformer blocks (vit: vision.n_layers).")
    d_model: int = Field(ge=1, le=MAX_WIDTH, description="Hidden size (vit: vision.d_model).")
    n_heads: int = Field(ge=1, le=MAX_HEADS, description="Attention (query) heads (vit: vision.n_heads).")
    n_kv_heads: int | None = Field(
        default=None, ge=1, le=MAX_HEADS, description="Key/value heads for grouped-query attention; None = n_heads."
    )
    ffn_hidden: int = Field(
        ge=1, le=MAX_WIDTH, description="Hidden size of the MLP (per expert under MoE; vit: vision.ffn_hidden)."
    )
    mlp: Literal["swiglu", "gelu"] = Field(default="swiglu", description="MLP kind.")
    vocab_size: int = Field(
        ge=2,
        le=MAX_VOCAB,
        description="Vocabulary size of the embedding and output layer (vit: vision.num_classes, the classifier's "
        "outputs).",
    )
    seq_len: int = Field(
        ge=1,
        le=MAX_SEQ_LEN,
        description="Training sequence length in tokens (vit: the encoder's tokens per image, patches plus the class "
        "token; vlm: the language model's whole sequence, the image's patch tokens and then the caption's).",
    )
    tie_embeddings: bool = Field(default=False, description="Share input embedding and output weights.")
    norm_eps: float = Field(default=1e-5, gt=0, le=1, description="RMSNorm epsilon.")
    rope_theta: float = Field(default=10000.0, gt=0, le=1e12, description="Rotary embedding base.")
    init_std: float = Field(default=0.02, gt=0, le=10, description="Std of the normal weight init.")
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout probability on the attention and MLP outputs before each residual add (training only).",
    )
    moe: MoEConfig | None = Field(default=None, description="Mixture-of-Experts MLP; None = dense.")
    init_from: StorageUrl | None = Field(
        default=None,
        description="Start from this Hugging Face checkpoint (a local folder or fsspec URL holding config.json and "
        "*.safetensors of a Llama, Mistral or Mixtral model) instead of random weights: the architecture fields the "
        "spec leaves out are read from its config.json, the ones it states must agree (training/hf_load.py). A "
        "resumed run continues from its own checkpoint. None = random initialisation.",
    )

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.d_model // self.n_heads

    @model_validator(mode="before")
    @classmethod
    def _vit_text_fields(cls, data: Any) -> Any:
        """kind vit: the text fields left out are filled in from `vision` (placeholders when `vision` is missing or
        invalid: its own error is the one reported)."""
        if not isinstance(data, dict) or data.get("kind") != "vit":
            return data
        try:
            vision = VisionConfig.model_validate(data.get("vision"))
        except ValidationError:
            vision = None
        placeholder = {"n_layers": 1, "d_model": 1, "n_heads": 1, "ffn_hidden": 1, "vocab_size": 2, "seq_len": 1}
        filled = dict(data)
        for name in _VIT_MIRRORED:
            filled.setdefault(name, placeholder[name] if vision is None else _vit_value(vision, name))
        return filled

    @model_validator(mode="after")
    def _shapes_agree(self) -> ModelConfig:
        if self.kind == "vit":
            raise_problems("ModelConfig", self._vit_problems())
            return self
        problems: list[Problem] = self._vision_problems()
        if self.d_model % self.n_heads:
            valid = [h for h in divisors(self.d_model) if h <= 128]
            problems.append(
                (("n_heads",), self.n_heads, f"must divide d_model={self.d_model}; use one of {valid[-6:]}")
            )
        elif self.head_dim % 2:
            problems.append(
                (("d_model",), self.d_model, f"d_model/n_heads={self.head_dim} must be even for rotary embeddings")
            )
        if self.n_heads % self.kv_heads:
            valid = divisors(self.n_heads)
            problems.append(
                (("n_kv_heads",), self.n_kv_heads, f"must divide n_heads={self.n_heads}; use one of {valid}")
            )
        raise_problems("ModelConfig", problems)
        return self

    def _vit_problems(self) -> list[Problem]:
        vision = self.vision
        if vision is None:
            return [(("vision",), None, "is required for kind vit: state the encoder (image_size, patch_size, "
                     "n_layers, d_model, n_heads, ffn_hidden, num_classes)")]  # fmt: skip
        problems: list[Problem] = []
        if vision.num_classes is None:
            problems.append((("vision", "num_classes"), None, "is required for kind vit: the image dataset's "
                             "number of classes"))  # fmt: skip
        if vision.projector_hidden is not None:
            problems.append((("vision", "projector_hidden"), vision.projector_hidden, "only applies to kind vlm; "
                             "remove it"))  # fmt: skip
        if vision.init_from is not None and vision.pooling != "cls":
            problems.append((("vision", "pooling"), vision.pooling, "a Hugging Face ViT (vision.init_from) reads a "
                             "class token; set vision.pooling: cls"))  # fmt: skip
        for name in _VIT_MIRRORED:
            want = _vit_value(vision, name)
            if getattr(self, name) != want and (name != "vocab_size" or vision.num_classes is not None):
                source = {"vocab_size": "vision.num_classes", "seq_len": "vision's tokens per image"}.get(
                    name, f"vision.{name}"
                )
                problems.append(((name,), getattr(self, name), f"for kind vit it is {source}={want}; remove it "
                                 "(it is filled in) or state the same value"))  # fmt: skip
        unused = {
            "n_kv_heads": (self.n_kv_heads is not None, "the encoder has as many key/value heads as heads"),
            "tie_embeddings": (self.tie_embeddings, "a classifier has no input embedding to share"),
            "moe": (self.moe is not None, "the encoder's MLP is dense"),
            "init_from": (self.init_from is not None, "model.init_from is a language model checkpoint; start "
                          "the encoder from a Hugging Face ViT with model.vision.init_from"),
        }  # fmt: skip
        for name, (bad, why) in unused.items():
            if bad:
                value = "{...}" if name == "moe" else getattr(self, name)
                problems.append(((name,), value, f"does not apply to kind vit ({why}); remove it"))
        return problems

    def _vision_problems(self) -> list[Problem]:
        """kind lm: no vision section; kind vlm: a SigLIP-shaped encoder without a head, room for the image."""
        vision = self.vision
        if self.kind == "lm":
            return [] if vision is None else [(("vision",), "{...}", "only applies to kind vit or vlm; remove it "
                                                "or set model.kind")]  # fmt: skip
        if vision is None:
            return [(("vision",), None, "is required for kind vlm: state the encoder (image_size, patch_size, "
                     "n_layers, d_model, n_heads, ffn_hidden)")]  # fmt: skip
        problems: list[Problem] = []
        if vision.num_classes is not None:
            problems.append((("vision", "num_classes"), vision.num_classes, "only applies to kind vit (a vlm's "
                             "encoder has no classifier head); remove it"))  # fmt: skip
        if vision.pooling != "mean":
            problems.append((("vision", "pooling"), vision.pooling, "a vlm's encoder is SigLIP-shaped (every patch "
                             "token goes to the projector, no class token); set vision.pooling: mean"))  # fmt: skip
        if self.seq_len <= vision.num_patches:
            problems.append((("seq_len",), self.seq_len, f"must exceed the image's {vision.num_patches} patch tokens "
                             "(the language model's sequence is the image's tokens, then the caption's); set it to "
                             f"{vision.num_patches} + the caption length"))  # fmt: skip
        for name, bad, why in (("moe", self.moe is not None, "use a dense language model"),
                               ("init_from", self.init_from is not None, "train from random weights (the encoder "
                                "may start from a SigLIP tower: model.vision.init_from)")):  # fmt: skip
            if bad:
                problems.append(((name,), getattr(self, name), f"is not supported with kind vlm yet; {why}"))
        return problems


class ParallelConfig(StrictModel):
    """How the model and the batch are spread over the training processes."""

    sharding: Literal["ddp", "fsdp", "hsdp"] = Field(
        default="ddp",
        description="ddp: replicate; fsdp: FSDP2 full shard (ZeRO-3 style) over all ranks; "
        "hsdp: shard within a node, replicate across nodes (2-D mesh).",
    )
    data_parallel: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RANKS,
        description="Data-parallel degree; must equal the number of training processes. None = all of them.",
    )
    hsdp_shard_size: int | None = Field(
        default=None, ge=1, le=MAX_RANKS, description="hsdp: ranks per shard group; None = processes per node."
    )
    micro_batch: int = Field(ge=1, le=MAX_BATCH, description="Sequences per rank per forward/backward pass.")
    grad_accum_steps: int = Field(
        default=1, ge=1, le=MAX_BATCH, description="Micro-batches accumulated per optimizer step."
    )
    activation_recompute: Literal["none", "selective", "full"] = Field(
        default="none",
        description="none; selective: recompute attention only; full: recompute every block in backward.",
    )
    ddp_grad_compression: Literal["bf16", "fp16"] | None = Field(
        default=None, description="ddp only: compress gradients for the all-reduce (DDP comm hook)."
    )
    ddp_bucket_cap_mb: float = Field(default=25.0, gt=0, le=65536, description="ddp only: gradient bucket size in MB.")
    tensor_parallel: int = Field(
        default=1,
        ge=1,
        le=MAX_HEADS,
        description="Tensor-parallel degree: attention heads and MLP columns split over this many ranks (keep it "
        "within a node). Ranks are placed tensor-parallel first.",
    )
    sequence_parallel: bool = Field(
        default=False,
        description="With tensor_parallel > 1: norms and dropout run on a 1/TP slice of the sequence "
        "(all-gather + reduce-scatter instead of all-reduce).",
    )
    pipeline_parallel: int = Field(
        default=1, ge=1, le=MAX_LAYERS, description="Pipeline stages: the layers are cut into this many ranks' stages."
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = Field(
        default="1f1b",
        description="Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, or interleaved-1f1b with "
        "virtual_stages model chunks per rank.",
    )
    virtual_stages: int = Field(
        default=1, ge=1, le=MAX_LAYERS, description="interleaved-1f1b: model chunks per pipeline rank (>= 2)."
    )
    pipeline_microbatches: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BATCH,
        description="Microbatches each pipeline step splits its micro_batch x grad_accum_steps sequences into "
        "(gradient accumulation is folded into them); None = grad_accum_steps.",
    )
    pipeline_split: list[int] | None = Field(
        default=None,
        max_length=MAX_LAYERS,
        description="Layers of each pipeline chunk, in order (pipeline_parallel x virtual_stages numbers summing "
        "to model.n_layers; uneven allowed, for example 126 layers on 16 stages); None = balanced, printed.",
    )
    expert_parallel: int = Field(
        default=1,
        ge=1,
        le=MAX_EXPERTS,
        description="MoE experts sharded over this many data-parallel ranks; tokens reach them by all-to-all.",
    )
    expert_capacity_factor: float | None = Field(
        default=None,
        gt=0,
        le=MAX_EXPERTS,
        description="Tokens an expert takes per step, as a multiple of the even share (tokens x top_k / experts); "
        "the rest are dropped and counted per step. None = dropless.",
    )
    context_parallel: int = Field(
        default=1,
        ge=1,
        le=MAX_RANKS,
        description="Context (ring-attention) parallel degree. Only 1 is accepted: planned only, see "
        "training/layout.py (PLANNED_ONLY).",
    )

    @property
    def model_parallel(self) -> bool:
        """Any of tensor, pipeline or expert parallelism is on (the device-mesh path of training/parallel.py)."""
        return self.tensor_parallel > 1 or self.pipeline_parallel > 1 or self.expert_parallel > 1

    @property
    def pipeline_chunks(self) -> int:
        """Pipeline model chunks over all ranks: stages x virtual stages."""
        virtual = self.virtual_stages if self.pipeline_schedule == "interleaved-1f1b" else 1
        return self.pipeline_parallel * virtual

    @property
    def n_microbatches(self) -> int:
        """Pipeline microbatches per optimizer step (grad_accum_steps unless pipeline_microbatches is set)."""
        return self.pipeline_microbatches or self.grad_accum_steps


class PrecisionConfig(StrictModel):
    """Numeric precision of the forward and backward passes (parameters stay fp32)."""

    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        default="fp32",
        description="fp32; bf16 autocast; fp16 autocast with dynamic loss scaling; fp8: bf16 autocast with the "
        "transformer blocks' Linear layers in float8 (torchao, rowwise scaling; embeddings and output head in bf16; "
        "GPUs of compute capability 8.9+ only, no tensor parallelism; exports are bf16). A deployment spec that "
        "leaves it out gets bf16 on a GPU accelerator, fp32 on CPU.",
    )
    fp16_init_scale: float = Field(default=2.0**16, gt=0, le=2.0**64, description="fp16: initial loss scale.")
    fp16_growth_interval_steps: int = Field(
        default=2000, ge=1, le=MAX_STEPS, description="fp16: overflow-free steps before the loss scale doubles."
    )

    @property
    def torch_name(self) -> str:
        """The torch dtype the forward runs in (float32, bfloat16, float16): the one to serve an export in (fp8:
        bfloat16, the autocast dtype around the float8 matmuls and what its weights are exported in)."""
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}[self.dtype]


class OptimConfig(StrictModel):
    """AdamW with linear warmup and a decay schedule."""

    name: Literal["adamw"] = Field(default="adamw", description="Optimizer.")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = Field(
        default="auto",
        description="AdamW's kernels: auto = fused on GPUs (one kernel for every parameter), PyTorch's own choice "
        "elsewhere; fused needs GPUs.",
    )
    lr_peak: float = Field(gt=0, le=10, description="Learning rate reached after warmup.")
    lr_min: float = Field(default=0.0, ge=0, le=10, description="Learning rate at the end of the decay.")
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS, description="Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = Field(default="cosine", description="Decay after warmup.")
    weight_decay: float = Field(default=0.1, ge=0, le=10, description="Decoupled weight decay (matrices only).")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(default=1e-8, gt=0, le=1, description="AdamW epsilon.")
    grad_clip_norm: float | None = Field(
        default=1.0, gt=0, le=1e9, description="Clip the global grad norm; None = off."
    )

    @model_validator(mode="after")
    def _lr_range(self) -> OptimConfig:
        if self.lr_min > self.lr_peak:
            raise_problems("OptimConfig", [(("lr_min",), self.lr_min, f"must be <= lr_peak={self.lr_peak}")])
        return self


class DataConfig(StrictModel):
    """Where the tokenized dataset is (format: training/dataset.py)."""

    dataset_url: StorageUrl = Field(description="Local path or fsspec URL of the tokenized dataset.")
    sources: list[StorageUrl] = Field(
        default_factory=list,
        max_length=1024,
        description="Adopted datasets (Megatron prefixes, dataset folders) whose files the manifest at dataset_url "
        "may name outside its own folder; the data step fills it from data.dataset_url.",
    )
    tokenizer_sha256: str | None = Field(
        default=None, description="Refuse a dataset made with another tokenizer (sha256 of tokenizer.json); None = any."
    )
    train_split: str = Field(
        default="train",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="Split used for training (a name: letters, digits, _ -).",
    )
    val_split: str = Field(
        default="val", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Held-out split used for evaluation (a name)."
    )
    drop_last: bool = Field(
        default=True,
        description="An epoch that does not divide into global batches leaves its last len % global_batch samples "
        "out (true); false pads its last batch with the epoch's first samples, so every sample is seen "
        "(training/sampler.py).",
    )


class CheckpointConfig(StrictModel):
    """Distributed checkpoints (torch.distributed.checkpoint) on any fsspec URL."""

    url: StorageUrl = Field(description="Local path or fsspec URL (s3://...) of the checkpoint folder.")
    save_every_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | Literal["auto"] | None = Field(
        default="auto",
        description="Save to storage every N steps; None = off (save_at_end only). auto: the Young/Daly optimum "
        "(training/checkpoint/interval.py) from the measured stall of a save and mtbf_s: the trainer saves once at "
        "step AUTO_FIRST_SAVE_STEP, measures how long it held training and the step time, and saves every optimum "
        "steps from there, chosen again after each save; with mtbf_s None (no failure rate known) it saves only at "
        "the end, as None does.",
    )
    mtbf_s: float | None = Field(
        default=None,
        gt=0,
        le=1e11,
        description="The job's mean time between failures (seconds) that save_every_steps=auto is chosen from. Set "
        "by the job step from the ledger's observed failures, else cluster.mttf_hours / cluster.nodes "
        "(tasks/recovery/exposure.py); a value here overrides both. None = unknown.",
    )
    save_at_end: bool = Field(default=True, description="Save after the last step.")
    async_save: bool = Field(
        default=True,
        description="Periodic saves run in the background: training waits only while the state is copied to host "
        "memory (pinned on GPUs; one more copy of each rank's model and optimizer state in RAM), then the files, "
        "their checksums and COMMIT.json follow while it trains. The next save, the last save and a preemption "
        "save wait for it first; a checkpoint is visible only once committed either way. false: every save "
        "holds training until it is committed.",
    )
    keep_last: int = Field(default=3, ge=1, le=10_000, description="Complete checkpoints kept; older ones are deleted.")
    resume: bool = Field(default=True, description="Resume from the latest complete checkpoint on start.")
    verify_checksums: bool = Field(default=True, description="Check sha256 of every file before loading.")
    save_retries: int = Field(
        default=2, ge=0, le=100, description="Retries of a failed save (transient storage errors)."
    )
    save_retry_backoff_s: float = Field(
        default=1.0, ge=0, le=3600, description="First retry delay; doubles each retry."
    )
    continue_on_save_failure: bool = Field(
        default=False,
        description="After the retries, log the lost checkpoint loudly and keep training (false: stop the job).",
    )
    memory_every_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] | Literal["auto"] | None = Field(
        default="auto",
        description="Every N steps each rank keeps a copy of its state in host memory (memory_dir) and sends one "
        "to a peer rank on another node; a restarted job restores from these copies, own or a peer's, before it "
        "reads storage (training/checkpoint/memory.py). Costs two copies of the rank's model and optimizer state "
        "in RAM per kept step (2 kept). auto: on when those copies of the node's ranks fit memory_budget_mib (or "
        "half the host memory available at start), every step unless its measured stall exceeds 5% of a step, "
        "then the smallest interval that keeps it within (at most save_every_steps); the decision goes to the "
        "run's memory_tier.jsonl (training/checkpoint/memory_auto.py). 0 or None = off.",
    )
    memory_budget_mib: float | None = Field(
        default=None,
        gt=0,
        le=2**40,
        description="Host memory (MiB) the in-memory copies may hold per node under memory_every_steps=auto; "
        "None = half of what the node has available at the trainer's start (MemAvailable, and the free space "
        "of memory_dir's filesystem).",
    )
    memory_dir: str | None = Field(
        default=None,
        max_length=4096,
        description="Node-local folder in host memory (tmpfs) for the in-memory copies; None = "
        "/dev/shm/tdeploy-memory. An absolute local path.",
    )

    @field_validator("save_every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        # Checked before the union, so that a bad value is named as the field itself, not as each union member.
        if value is None or value == "auto":
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if 1 <= value <= MAX_STEPS:
                return value
            bound = f"must be <= {MAX_STEPS}" if value > MAX_STEPS else "must be >= 1"
            raise ValueError(f"{bound} (steps between saves), or auto, or null (off)")
        raise ValueError(f"must be a number of steps from 1 to {MAX_STEPS}, auto (the Young/Daly optimum from the "
                         "measured stall and checkpoint.mtbf_s) or null (off)")

    @property
    def memory_tier_on(self) -> bool:
        """Whether the in-memory tier may take copies (an interval, or auto: decided by the trainer)."""
        return self.memory_every_steps not in (None, 0)

    @model_validator(mode="after")
    def _memory_dir_is_local(self) -> CheckpointConfig:
        value = self.memory_dir
        if value is None:
            return self
        problem = None
        if _CONTROL.search(value):
            problem = "has a control character; use a plain absolute path such as /dev/shm/tdeploy-memory"
        elif not value.startswith("/") or "://" in value:
            problem = "is not an absolute local path; use a tmpfs folder such as /dev/shm/tdeploy-memory"
        elif ".." in value.split("/"):
            problem = "has a '..' part; name the folder without it, e.g. /dev/shm/tdeploy-memory"
        if problem:
            raise_problems("CheckpointConfig", [(("memory_dir",), value, problem)])
        return self


class RunConfig(StrictModel):
    """Length, seed, outputs and cadence of the training run."""

    steps: int = Field(ge=1, le=MAX_STEPS, description="Optimizer steps to train for (the LR schedule spans them).")
    stop_after_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEPS,
        description="End this launch early at this step, schedule unchanged; None = run.steps.",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed for init, data order and every RNG.")
    output_url: StorageUrl = Field(description="Local folder for metrics, ranks.json and sample records.")
    log_every_steps: int = Field(default=10, ge=1, le=MAX_STEPS, description="Rank 0 logs a line every N steps.")
    stop_on_nonfinite_loss: bool = Field(
        default=True,
        description="Stop the job when a step's loss is NaN or infinite and no fp16 loss scaler skipped it (seen "
        "when the step's figures are read: every run.metrics_sync_every_steps): a workload error (failure.json), "
        "which the restart policy does not retry. false: log it and train on.",
    )
    compile: bool | None = Field(
        default=None,
        description="torch.compile each transformer block (in place: checkpoints keep their keys); data-parallel "
        "layouts (ddp, fsdp, hsdp) only. The first steps pay the compilation. None = on for GPU jobs with a "
        "data-parallel layout, off on CPU and with tensor, pipeline or expert parallelism.",
    )
    metrics_sync_every_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEPS,
        description="Read the step's device figures (loss, gradient norm) on the host every N steps, each step's "
        "record written then: between reads the host never waits for the accelerator. None = every step on CPU "
        "(nothing to wait for), log_every_steps on GPUs. Preemption signals are still agreed every step, over "
        "the host.",
    )
    eval_every_steps: int | None = Field(
        default=None, ge=1, le=MAX_STEPS, description="Validation every N steps; None = end only."
    )
    eval_batches: int = Field(
        default=4, ge=1, le=MAX_BATCH, description="Validation micro-batches per rank per evaluation."
    )
    threads_per_rank: int | None = Field(
        default=None, ge=1, le=1024, description="torch intra-op threads per rank; None = CPU cores / local ranks."
    )
    record_samples: bool = Field(default=True, description="Record the sample indices each rank consumed.")
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Serve Prometheus metrics at http://HOST:PORT/metrics, one port per rank "
        "(metrics_port + local rank, so keep that many ports free); None = off.",
    )
    throughput_baseline_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        le=1e15,
        description="Accepted tokens/s of this job (the acceptance run's figure), exported as "
        "tdeploy_train_baseline_tokens_per_second for the throughput-drop alert; None = no baseline, no alert.",
    )
    comm_probe_mb: list[Annotated[float, Field(gt=0, le=MAX_COMM_PROBE_MB)]] | None = Field(
        default=None,
        min_length=1,
        max_length=8,
        description="At start-up, measure all-reduce bus bandwidth (nccl-tests' busbw) for these message sizes in "
        "MiB, and each host pair's bandwidth with the largest (training/comm_probe.py), into ranks.json; for example "
        "[1, 8, 32]. None = off.",
    )


class WatchdogConfig(StrictModel):
    """Hang detection per phase (training/watchdog.py): a rank that stays in one phase longer than its timeout dumps
    the stacks of its threads, records the hang (<output>/hangs.jsonl, naming the ranks that did not arrive) and
    exits with HANG_EXIT_CODE, so that torchrun's restart (cluster.max_restarts) recovers the job.

    Judged by wall time: a hung rank burns no CPU. None = that phase is not timed, except the step, whose default
    is derived from the job's own measured steps (the auto rule of step_timeout_s)."""

    enabled: bool = Field(default=True, description="Run the watchdog and write per-rank heartbeats; False = off.")
    startup_timeout_s: float | None = Field(
        default=1800.0,
        gt=0,
        le=7 * 86400,
        description="From the rendezvous to the end of the first step (model build, resume, first step); "
        "None = not timed.",
    )
    step_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86400,
        description="Longest training step; None = auto: max(step_timeout_floor_s, step_timeout_factor x the "
        "slowest of the last step_timeout_window_steps steps), from the job's own measured steps, so that a slow "
        "or busy machine (whose every step is slow, or spiky) widens its own tolerance.",
    )
    step_timeout_factor: float = Field(
        default=10.0, ge=1, le=1e6, description="Auto step timeout: multiple of the slowest recent step."
    )
    step_timeout_floor_s: float = Field(
        default=60.0, gt=0, le=7 * 86400, description="Auto step timeout: never shorter than this."
    )
    step_timeout_window_steps: int = Field(
        default=50, ge=1, le=100_000, description="Auto step timeout: recent steps whose slowest sets the timeout."
    )
    save_timeout_s: float | None = Field(
        default=None, gt=0, le=7 * 86400, description="Longest checkpoint save (the part training waits for); "
        "None = not timed (the storage's own retries and timeouts apply).",
    )  # fmt: skip
    eval_timeout_s: float | None = Field(
        default=None, gt=0, le=7 * 86400, description="Longest evaluation; None = not timed."
    )


class FaultToleranceConfig(StrictModel):
    """Live recovery of a lost data-parallel replica (training/replica.py, torchft): each node is a replica group
    with its own torchrun rendezvous under a torchft lighthouse; a lost group is restarted and pulls the model,
    optimizer and training state from a healthy group while the others go on training without reloading."""

    mode: Literal["none", "replica_groups"] = Field(
        default="none",
        description="none: one torchrun job, every failure restarts it; replica_groups: one replica group per node "
        "(parallel.sharding=ddp only), a lost group heals from a peer.",
    )
    replica_groups: int = Field(
        default=2, ge=2, le=MAX_RANKS, description="replica_groups: how many replica groups the launcher starts."
    )
    min_replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_RANKS,
        description="replica_groups: fewest groups that may commit a step; fewer alive stalls training until one "
        "comes back.",
    )
    timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="replica_groups: cross-group collectives and the state transfer."
    )
    quorum_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="replica_groups: longest wait for a quorum of groups at a step."
    )
    heartbeat_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="replica_groups: the lighthouse drops a group whose heartbeats stop for this long "
        "(the detection time of a lost group).",
    )

    @model_validator(mode="after")
    def _groups(self) -> FaultToleranceConfig:
        if self.min_replicas > self.replica_groups:
            raise ValueError(
                f"min_replicas={self.min_replicas} exceeds replica_groups={self.replica_groups}; "
                f"use at most {self.replica_groups}"
            )
        return self


class DistillConfig(StrictModel):
    """Knowledge distillation (training/distill.py): the model trains as the student of a frozen teacher, on
    alpha x T^2 x KL(teacher || student, both softened by the temperature T) + (1 - alpha) x cross-entropy."""

    teacher_url: StorageUrl = Field(
        description="The teacher: a checkpoint folder of ours (another run's checkpoint.url; teacher_kind "
        "checkpoint) or a Hugging Face model folder, safetensors and config.json (teacher_kind hf)."
    )
    teacher_kind: Literal["checkpoint", "hf"] = Field(
        default="checkpoint", description="checkpoint: one of our checkpoints; hf: a Hugging Face folder."
    )
    teacher_step: int | None = Field(
        default=None,
        ge=0,
        le=MAX_STEPS,
        description="teacher_kind checkpoint: the step to load; None = the newest sound checkpoint.",
    )
    teacher_model: ModelConfig | None = Field(
        default=None,
        description="The teacher's architecture. None = read at start from the checkpoint's model.json or the "
        "folder's config.json; the spec step fills it in so that a mismatch is found before the job starts.",
    )
    alpha: float = Field(
        default=0.5, ge=0, le=1, description="Weight of the KL term; 1 - alpha weighs the cross-entropy on the data."
    )
    temperature: float = Field(
        default=2.0,
        gt=0,
        le=100,
        description="Softmax temperature of both teacher and student in the KL term (Hinton et al. 2015); the "
        "term is multiplied by T^2 so that its gradients keep their scale as T changes.",
    )

    @model_validator(mode="after")
    def _step_of_a_checkpoint(self) -> DistillConfig:
        if self.teacher_step is not None and self.teacher_kind != "checkpoint":
            raise_problems(
                "DistillConfig",
                [(("teacher_step",), self.teacher_step, "only applies to teacher_kind=checkpoint; remove it")],
            )
        return self


def distill_problems(distill: DistillConfig, student: ModelConfig, par: ParallelConfig) -> list[Problem]:
    """Why this teacher cannot teach this student under this layout (the teacher's stated or read architecture)."""
    problems: list[Problem] = []
    for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel"):
        if getattr(par, name) > 1:
            problems.append(
                (
                    ("parallel", name),
                    getattr(par, name),
                    "distillation (the distill section) runs under data-parallel layouts only (ddp, fsdp, hsdp: the "
                    f"teacher is replicated on every rank); set parallel.{name}=1 or remove the distill section",
                )
            )
    teacher = distill.teacher_model
    if teacher is not None and teacher.vocab_size != student.vocab_size:
        problems.append(
            (
                ("distill", "teacher_model", "vocab_size"),
                teacher.vocab_size,
                f"the teacher's vocabulary must be the student's (model.vocab_size={student.vocab_size}): the KL "
                "term compares their distributions token by token; distil from a teacher of the same tokenizer and "
                f"vocabulary, or set model.vocab_size to {teacher.vocab_size}",
            )
        )
    return problems


class ReferenceConfig(StrictModel):
    """The independent correctness reference (training/reference.py) of a distributed job."""

    world_size: int = Field(
        ge=1,
        le=MAX_RANKS,
        description="Ranks of the distributed job it stands in for: its global batch is "
        "parallel.micro_batch x parallel.grad_accum_steps x world_size.",
    )


class TrainConfig(StrictModel):
    """Everything the training payload needs, and nothing else."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    optim: OptimConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    run: RunConfig
    storage: StorageConfig = Field(default_factory=StorageConfig)
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig, description="Hang detection per phase (training/watchdog.py)."
    )
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig,
        description="Live recovery of a lost data-parallel replica group (training/replica.py).",
    )
    reference: ReferenceConfig | None = Field(
        default=None,
        description="Run the independent reference (training/reference.py) instead of the trainer. Set only by "
        "the acceptance suite: a deployment spec has no such section; None = train.",
    )
    init_check_url: StorageUrl | None = Field(
        default=None,
        description="With model.init_from: the init_check.json the pipeline wrote (transformers' fp32 logits of the "
        "checkpoint on a fixed prompt, training/hf_load.py); after loading the weights under its layout the job "
        "computes its own and refuses to start when they differ beyond tolerance. Set by the pipeline, not the "
        "spec; None = no check.",
    )
    distill: DistillConfig | None = Field(
        default=None, description="Train as the student of a frozen teacher (training/distill.py); None = off."
    )

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        raise_problems("TrainConfig", training_problems(self))
        return self

    @classmethod
    def from_json_file(cls, path: str | Path) -> TrainConfig:
        """Read the config written by `to_json_file` (the cluster side of the boundary)."""
        return cls.model_validate_json(Path(path).read_text())

    def to_json_file(self, path: str | Path) -> None:
        """Write the config as JSON for `torchrun -m training.train --config`."""
        Path(path).write_text(self.model_dump_json(indent=2))


def training_problems(cfg: TrainConfig | Any) -> list[Problem]:
    """Cross-section checks over the parallel, precision, optim and run sections of `cfg`.

    Also called on a whole deployment spec, which carries the same sections under the same names.
    """
    problems: list[Problem] = []
    par = cfg.parallel
    ft = getattr(cfg, "fault_tolerance", None)
    if ft is not None and ft.mode == "replica_groups" and (par.sharding != "ddp" or par.model_parallel):
        layout = (
            f"sharding={par.sharding}, tensor={par.tensor_parallel}, pipeline={par.pipeline_parallel}, "
            f"expert={par.expert_parallel}"
        )
        problems.append(
            (
                ("fault_tolerance", "mode"),
                "replica_groups",
                f"replica groups replicate the whole model (parallel.sharding=ddp, no tensor, pipeline or expert "
                f"parallelism); got {layout}: use sharding=ddp, or set fault_tolerance.mode=none and recover "
                "through the memory tier (checkpoint.memory_every_steps) or storage",
            )
        )
    if cfg.precision.dtype == "fp16" and par.sharding != "ddp":
        problems.append(
            (
                ("precision", "dtype"),
                "fp16",
                f"fp16 loss scaling is supported with parallel.sharding=ddp only (got {par.sharding}); "
                "use bf16 with fsdp/hsdp",
            )
        )
    if cfg.precision.dtype == "fp8" and par.tensor_parallel > 1:
        problems.append(
            (
                ("precision", "dtype"),
                "fp8",
                f"float8 training is not supported with parallel.tensor_parallel={par.tensor_parallel} (torchao's "
                "float8 tensor-parallel styles are tensorwise-only, and this payload's tensor-parallel regions are "
                "not float8-aware); set parallel.tensor_parallel: 1 (fp8 runs with ddp, fsdp and hsdp), or "
                "precision.dtype: bf16",
            )
        )
    if par.ddp_grad_compression is not None and par.sharding != "ddp":
        problems.append(
            (
                ("parallel", "ddp_grad_compression"),
                par.ddp_grad_compression,
                f"only applies to sharding=ddp (got {par.sharding}); remove it",
            )
        )
    if cfg.run.compile and par.model_parallel:
        problems.append(
            (
                ("run", "compile"),
                True,
                "compiles the blocks of data-parallel layouts only (ddp, fsdp, hsdp); with tensor, pipeline or "
                "expert parallelism set run.compile: false",
            )
        )
    if par.hsdp_shard_size is not None and par.sharding != "hsdp":
        problems.append(
            (("parallel", "hsdp_shard_size"), par.hsdp_shard_size, "only applies to sharding=hsdp; remove it")
        )
    problems.extend(vision_layout_problems(cfg))
    from training.layout import layout_problems  # noqa: PLC0415 - layout imports this module

    problems.extend(layout_problems(cfg.model, par, cfg.precision.dtype))
    distill = getattr(cfg, "distill", None)
    if distill is not None:
        problems.extend(distill_problems(distill, cfg.model, par))
        if distill.teacher_url.rstrip("/") == cfg.checkpoint.url.rstrip("/"):
            problems.append(
                (
                    ("distill", "teacher_url"),
                    distill.teacher_url,
                    "is this run's own checkpoint.url, which the student's checkpoints go to; point it at the "
                    "teacher run's checkpoint folder",
                )
            )
    if cfg.optim.warmup_steps > cfg.run.steps:
        problems.append((("optim", "warmup_steps"), cfg.optim.warmup_steps, f"must be <= run.steps={cfg.run.steps}"))
    return problems


def resolve_compile(run: RunConfig, parallel: ParallelConfig, device_type: str) -> bool:
    """Whether the blocks are compiled: run.compile where the spec sets it, else on for a GPU ("cuda") job with a
    data-parallel layout and off on CPU (compilation costs more there than it gains) and under tensor, pipeline or
    expert parallelism (the layouts run.compile does not support)."""
    if run.compile is not None:
        return run.compile
    return device_type == "cuda" and not parallel.model_parallel


def vision_layout_problems(cfg: TrainConfig | Any) -> list[Problem]:
    """What kind vit and vlm do not run: pipeline and expert parallelism, sequence parallelism,
    distillation; and tensor parallelism must split the encoder's heads and MLP evenly."""
    model, par = cfg.model, cfg.parallel
    if model.kind == "lm" or model.vision is None:
        return []
    problems: list[Problem] = []
    kind = f"model.kind={model.kind}"
    for name, fix in (("pipeline_parallel", "use tensor_parallel or fsdp to fit the model"),
                      ("expert_parallel", "the model has no experts")):  # fmt: skip
        if getattr(par, name) > 1:
            problems.append((("parallel", name), getattr(par, name), f"is not supported with {kind} (data "
                             f"parallelism, fsdp and tensor_parallel are); set it to 1: {fix}"))  # fmt: skip
    if par.sequence_parallel:  # vlm: the image tokens go in front of the captions', which would be a sequence shard
        problems.append((("parallel", "sequence_parallel"), True, f"is not supported with {kind}; remove it "
                         "(tensor_parallel alone splits the encoder's heads and MLP)"))  # fmt: skip
    tp, vision = par.tensor_parallel, model.vision
    if tp > 1 and model.kind == "vlm":  # a vit's are model.n_heads and model.ffn_hidden, which layout.py checks
        for name in ("n_heads", "ffn_hidden"):
            value = getattr(vision, name)
            if value % tp:
                ok = [d for d in divisors(value) if d <= 64]
                problems.append((("parallel", "tensor_parallel"), tp, f"must divide model.vision.{name}={value} "
                                 f"(the encoder is split by heads and MLP columns); use one of {ok[-6:]}"))  # fmt: skip
    if getattr(cfg, "distill", None) is not None:
        problems.append((("distill",), "{...}", f"distillation is not supported with {kind} (its teacher is a "
                         "language model); remove the distill section"))  # fmt: skip
    return problems
