"""A Hugging Face vision tower (`model.vision.init_from`) as the encoder's starting weights.

What is read: config.json, checked field by field against model.vision (`check_vision_config`): a ViTModel /
ViTForImageClassification (model_type "vit") for kind vit, a SiglipVisionModel (model_type "siglip_vision_model")
for kind vlm. Nothing is filled in from it: image_size, patch_size, num_channels, hidden_size, num_hidden_layers,
num_attention_heads, intermediate_size and layer_norm_eps must equal the spec's, and hidden_act must be exact GELU
("gelu"; the encoder has no tanh approximation), each disagreement refused naming both values. Custom code
(auto_map) and quantized weights are refused as for the language model (training/hf_load.py).

How it is read (`load_vision_into`): *.safetensors only, by tensor, through the ONE name table the exporters write
with (training/hf_vision_names.py), cast to fp32; each rank reads only its own slice of an FSDP- or TP-sharded
parameter (hf_load's machinery). The check is completeness: every encoder parameter is read from the checkpoint
with its shape, and every checkpoint tensor is either read or on the short list of tensors the payload's encoder
has no use for (SigLIP's post_layernorm and attention-pooling head, ViT's pooler, a classifier whose class count
differs): anything else refuses the start (HFLoadError, a workload error, never retried). A logits-level check
against transformers (as the language model's init_check.json) is not done for the encoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training import hf_vision_names
from training.config import ModelConfig, VisionConfig
from training.hf_config import HF_CONFIG, HFLoadError, _read_json, tensor_index, weight_files
from training.hf_load import _local_part, _plain_name, _read
from training.storage import StorageConfig

FIELD = "model.vision.init_from"
MODEL_TYPES = {"vit": ("vit",), "vlm": ("siglip_vision_model",)}
EXACT_GELU = ("gelu",)
# (config.json field, our model.vision field)
AGREEING = (
    ("image_size", "image_size"),
    ("patch_size", "patch_size"),
    ("num_channels", "channels"),
    ("hidden_size", "d_model"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("intermediate_size", "ffn_hidden"),
    ("layer_norm_eps", "norm_eps"),
)
_UNUSED = {
    "vit": ("pooler.",),
    "vlm": ("post_layernorm.", "head."),
}


def _prefix(index: dict[str, Any], kind: str) -> str:
    """The prefix the checkpoint's encoder tensors carry ("vit." in a classifier, "vision_model." in SigLIP)."""
    probe = "embeddings.patch_embeddings.projection.weight" if kind == "vit" else "embeddings.patch_embedding.weight"
    for prefix in ("", "vit.", "vision_model."):
        if prefix + probe in index:
            return prefix
    raise HFLoadError(f"{FIELD} tensor", probe, "missing: the checkpoint holds no patch embedding of a "
                      f"{'ViT' if kind == 'vit' else 'SigLIP vision'} model", "point it at a save_pretrained folder "
                      "of that model")  # fmt: skip


def vision_config_problems(config: dict[str, Any], vision: VisionConfig, kind: str) -> list[str]:
    """Each way config.json disagrees with model.vision, as `field=value` sentences naming both values."""
    found = []
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES[kind]:
        want = "a ViTModel / ViTForImageClassification (model_type vit)" if kind == "vit" else (
            "a SiglipVisionModel (model_type siglip_vision_model)")  # fmt: skip
        found.append(f"model_type={model_type}: kind {kind} starts from {want}")
        return found
    for name, problem in (("auto_map", "needs its own code (trust_remote_code), which this pipeline never runs"),
                          ("quantization_config", "quantized weights cannot be fine-tuned in full precision")):
        if config.get(name):
            found.append(f"{name}={config[name]}: {problem}")  # fmt: skip
    act = config.get("hidden_act", "gelu")
    if act not in EXACT_GELU:
        found.append(f"hidden_act={act}: the encoder's MLP uses exact GELU (erf); start from a tower with "
                     "hidden_act gelu")  # fmt: skip
    if kind == "vit" and config.get("qkv_bias", True) is not True:
        found.append(f"qkv_bias={config.get('qkv_bias')}: the encoder's query/key/value projections have biases")
    for theirs, ours in AGREEING:
        value, want = config.get(theirs), getattr(vision, ours)
        same = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            abs(float(value) - float(want)) <= 1e-12 * max(1.0, abs(float(want))) if ours == "norm_eps"
            else value == want)  # fmt: skip
        if not same:
            found.append(f"{theirs}={value} in config.json but model.vision.{ours}={want}: state "
                         f"model.vision.{ours}: {value} (or start from a tower of the spec's shape)")  # fmt: skip
    return found


def check_vision_config(url: str, vision: VisionConfig, kind: str, storage: StorageConfig | None = None) -> None:
    """HFLoadError naming every disagreement between the tower's config.json and model.vision."""
    config = _read_json(url, HF_CONFIG, storage)
    if not isinstance(config, dict):
        raise HFLoadError(f"{url}/{HF_CONFIG}", type(config).__name__, "is not a JSON object", "restore the file")
    problems = vision_config_problems(config, vision, kind)
    if problems:
        raise HFLoadError(FIELD, url, "the tower does not match model.vision: " + "; ".join(problems),
                          "make model.vision agree with the checkpoint's config.json")  # fmt: skip
    weight_files(url, storage)


@torch.no_grad()
def load_vision_into(module: nn.Module, model: ModelConfig, storage: StorageConfig | None = None) -> int:
    """Copy the tower's weights into the encoder of `module` (the whole model, DDP- or FSDP-wrapped or TP-sharded):
    each rank reads only its own slice. The number of parameters loaded; HFLoadError when anything is missing,
    mis-shaped or left over."""
    vision = model.vision
    assert vision is not None and vision.init_from is not None
    url, kind = str(vision.init_from), model.kind
    check_vision_config(url, vision, kind, storage)
    index = tensor_index(url, storage)
    prefix = _prefix(index, kind)
    table = hf_vision_names.VIT if kind == "vit" else hf_vision_names.SIGLIP
    ours_prefix = "vision." if kind == "vlm" else ""
    used: set[str] = set()
    loaded = 0
    for name, param in module.named_parameters():
        plain = _plain_name(name)
        if not plain.startswith(ours_prefix):
            continue  # the vlm's projector and language model
        inner = plain.removeprefix(ours_prefix)
        if kind == "vit" and inner.startswith("head."):
            theirs = hf_vision_names.translate(inner, hf_vision_names.VIT_HEAD)
            entry = index.get(theirs or "")
            if entry is None or tuple(entry.shape) != tuple(param.shape):
                continue  # no classifier of this class count: the head starts random
        else:
            mapped = hf_vision_names.translate(inner, table)
            if mapped is None:
                raise HFLoadError(f"{FIELD} parameter", plain, "has no name in the shared table "
                                  "(training/hf_vision_names.py)", "report it: the encoder and the table disagree")
            theirs = prefix + mapped
            entry = index.get(theirs)
            if entry is None:
                raise HFLoadError(f"{FIELD} tensor", theirs, f"missing: the encoder needs it for {plain}",
                                  "check that config.json and the weights belong together")  # fmt: skip
        local, part = _local_part(param)
        shape = tuple(param.shape)
        if tuple(entry.shape) != shape:
            if entry.shape and shape and int(torch.Size(entry.shape).numel()) == int(torch.Size(shape).numel()) and (
                    inner == "pos_emb"):  # SigLIP's nn.Embedding (n, d) against our (1, n, d)
                value = _read(url, storage, entry, theirs, None).reshape(shape)
                value = value[part] if part else value
            else:
                raise HFLoadError(f"{FIELD} tensor {theirs}", list(entry.shape), f"model.vision gives {plain} the "
                                  f"shape {list(shape)}", "make model.vision agree with config.json")  # fmt: skip
        else:
            value = _read(url, storage, entry, theirs, part)
        local.copy_(value.to(local.device, local.dtype))
        used.add(theirs)
        loaded += 1
    unused = _UNUSED[kind]
    left = sorted(
        name for name in index
        if name not in used and not name.removeprefix(prefix).startswith(unused)
        and not (kind == "vit" and name.startswith("classifier."))
    )  # fmt: skip
    if left:
        raise HFLoadError(f"{FIELD} tensors", left[:5], f"{len(left)} tensor(s) of the checkpoint have no place in "
                          "the encoder (the architecture differs)", "start from a plain ViT / SigLIP vision tower")
    return loaded
