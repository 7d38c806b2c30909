"""A Hugging Face checkpoint folder (`model.init_from`) read without torch: config.json validated, the tensors'
places from the safetensors headers.

What training/hf_load.py loads the weights by, and what the spec (tasks/init_from.py) checks a folder with before
anything is launched; kept apart from the loader so that reading a spec does not import torch. What config.json
may say is in training/hf_load.py's docstring.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from training.hf_names import UnknownName, our_name
from training.storage import ControlFileError, StorageConfig, filesystem, join, read_control_file

HF_CONFIG = "config.json"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header

SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
_ROPE_DEFAULT_THETA = {"llama": 10000.0, "mistral": 10000.0, "mixtral": 1e6}
_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_IGNORED = ("rotary_emb.inv_freq",)  # older Llama checkpoints save the rotary table; ours derives it from rope_theta


class HFLoadError(ValueError):
    """A Hugging Face checkpoint the payload cannot start from: `field` = `value` is what is at fault."""

    def __init__(self, field: str, value: Any, problem: str, fix: str) -> None:
        super().__init__(f"{field}={value}: {problem}; {fix}")
        self.field, self.value, self.problem, self.fix = field, value, problem, fix


@dataclass(frozen=True)
class HFArchitecture:
    """What config.json says, validated: the model type and our ModelConfig fields it determines."""

    url: str
    model_type: str
    fields: dict[str, Any]
    """ModelConfig fields (n_layers, d_model, ...) as config.json gives them."""
    max_position_embeddings: int
    sliding_window: int | None
    dtype: str | None
    """The dtype the weights were saved in (torch_dtype / dtype), e.g. bfloat16; loaded as fp32."""


def _refusals(config: dict[str, Any], model_type: str) -> list[tuple[str, Any, str, str]]:
    """(field, value, problem, fix) for every config.json field our Transformer computes differently."""
    found = []

    def refuse(name: str, problem: str, fix: str) -> None:
        found.append((name, config.get(name), problem, fix))

    if config.get("auto_map"):
        refuse("auto_map", "the model needs its own code (trust_remote_code), which this pipeline never runs",
               "start from a model transformers implements itself (Llama, Mistral, Mixtral)")  # fmt: skip
    if config.get("quantization_config"):
        refuse("quantization_config", "quantized weights cannot be fine-tuned in full precision here",
               "start from the unquantized checkpoint")  # fmt: skip
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the payload's SwiGLU MLP uses silu", "start from a silu model")
    if config.get("rope_scaling"):
        refuse("rope_scaling", "the payload's rotary embedding has no scaling (linear, dynamic, yarn, llama3)",
               "start from a model with default rotary embeddings")  # fmt: skip
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        found.append(("rope_parameters.rope_type", rope.get("rope_type"),
                      "the payload's rotary embedding has no scaling", "start from a model with rope_type default"))
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            refuse(name, "the payload's linear layers have no biases", "start from a model without biases")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    head_dim = config.get("head_dim")
    shaped = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
    if head_dim is not None and shaped and head_dim * heads != hidden:
        refuse("head_dim", f"the payload's heads are hidden_size / num_attention_heads = {hidden // heads} wide",
               "start from a model whose head_dim is hidden_size / num_attention_heads")  # fmt: skip
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", "the payload rotates the whole head", "start from a model with full rotary")
    if model_type == "mixtral" and config.get("router_jitter_noise"):
        refuse("router_jitter_noise", "the payload's router adds no noise", "start from a model without it")
    return found


def _read_json(url: str, name: str, storage: StorageConfig | None) -> Any:
    fs, root = filesystem(url, storage)
    path = join(root, name)
    try:
        raw = read_control_file(fs, path, MAX_CONFIG_BYTES)
    except FileNotFoundError as err:
        raise HFLoadError("model.init_from", url, f"has no {name}",
                          "point it at a Hugging Face model folder (config.json and *.safetensors)") from err
    except ControlFileError as err:
        raise HFLoadError("model.init_from", url, f"{name}: {err}", "use a folder saved by save_pretrained") from err
    try:
        return json.loads(raw)
    except ValueError as err:
        raise HFLoadError(f"{url}/{name}", "...", f"is not JSON ({err})", "restore the file") from err


def weight_files(url: str, storage: StorageConfig | None = None) -> list[str]:
    """The *.safetensors files of the folder (names, sorted); HFLoadError when it holds pickle weights only or none."""
    fs, root = filesystem(url, storage)
    try:
        names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))
    except FileNotFoundError as err:
        raise HFLoadError("model.init_from", url, "no such folder", "point it at a Hugging Face model folder") from err
    found = [n for n in names if n.endswith(".safetensors")]
    if found:
        return found
    pickled = [n for n in names if n.endswith(_PICKLED)]
    if pickled:
        raise HFLoadError("model.init_from", url, f"holds pickle weights ({', '.join(pickled[:3])}): safetensors only "
                          "(unpickling runs whatever code the file names)",
                          "convert the model to safetensors (save_pretrained(..., safe_serialization=True)) "
                          "where you trust it, and point model.init_from at that folder")  # fmt: skip
    raise HFLoadError("model.init_from", url, "holds no *.safetensors weights", "point it at a model folder")


def read_hf_config(url: str, storage: StorageConfig | None = None) -> HFArchitecture:
    """config.json of the Hugging Face folder `url`, validated (HFLoadError naming the first field refused)."""
    config = _read_json(url, HF_CONFIG, storage)
    if not isinstance(config, dict):
        raise HFLoadError(f"{url}/{HF_CONFIG}", type(config).__name__, "is not a JSON object", "restore the file")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise HFLoadError("model_type", model_type, f"the payload's Transformer is a {', '.join(SUPPORTED)} model",
                          "start from a Llama, Mistral or Mixtral checkpoint")  # fmt: skip
    refused = _refusals(config, model_type)
    if refused:
        raise HFLoadError(*refused[0])
    architectures = config.get("architectures") or [SUPPORTED[model_type]]
    if architectures != [SUPPORTED[model_type]]:
        raise HFLoadError("architectures", architectures, f"a {model_type} checkpoint of the payload's kind is a "
                          f"{SUPPORTED[model_type]}", "start from a causal language model checkpoint")  # fmt: skip
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [name for name in required if not isinstance(config.get(name), int)]
    if missing:
        raise HFLoadError(missing[0], config.get(missing[0]), "config.json must give it as an integer",
                          "use a config.json saved by transformers")  # fmt: skip
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = config.get("rope_theta", rope.get("rope_theta", _ROPE_DEFAULT_THETA[model_type]))
    fields: dict[str, Any] = {
        "n_layers": config["num_hidden_layers"],
        "d_model": config["hidden_size"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "ffn_hidden": config["intermediate_size"],
        "mlp": "swiglu",
        "vocab_size": config["vocab_size"],
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "moe": None,
    }
    if model_type == "mixtral":
        fields["moe"] = {
            "n_experts": config.get("num_local_experts", 8),
            "top_k": config.get("num_experts_per_tok", 2),
            "aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
        }
    weight_files(url, storage)
    return HFArchitecture(
        url=url,
        model_type=model_type,
        fields=fields,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        sliding_window=config.get("sliding_window") if model_type != "llama" else None,
        dtype=config.get("torch_dtype") or config.get("dtype"),
    )


# ---- tensors ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of the checkpoint lies: its file, dtype, shape and byte range in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _header(fs: Any, path: str) -> tuple[dict[str, Any], int]:
    """The safetensors header of `path` and the offset its data starts at."""
    head = fs.cat_file(path, start=0, end=8)
    if len(head) != 8:
        raise HFLoadError(path, len(head), "is shorter than a safetensors header", "restore the file")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES:
        raise HFLoadError(path, size, "declares a header larger than safetensors allows", "restore the file")
    try:
        header = json.loads(fs.cat_file(path, start=8, end=8 + size))
    except ValueError as err:
        raise HFLoadError(path, "...", f"has no JSON safetensors header ({err})", "restore the file") from err
    if not isinstance(header, dict):
        raise HFLoadError(path, type(header).__name__, "has a header that is not a JSON object", "restore the file")
    return header, 8 + size


def tensor_index(url: str, storage: StorageConfig | None = None) -> dict[str, TensorEntry]:
    """Every tensor of the folder's *.safetensors by its Hugging Face name (headers only are read)."""
    fs, root = filesystem(url, storage)
    index: dict[str, TensorEntry] = {}
    for name in weight_files(url, storage):
        header, data_start = _header(fs, join(root, name))
        for tensor, meta in header.items():
            if tensor == "__metadata__":
                continue
            try:
                begin, end = (int(n) for n in meta["data_offsets"])
                entry = TensorEntry(name, str(meta["dtype"]), tuple(int(n) for n in meta["shape"]), begin, end)
            except (KeyError, TypeError, ValueError) as err:
                raise HFLoadError(f"{url}/{name} tensor {tensor}", "...", f"has a malformed header entry ({err})",
                                  "restore the file") from err  # fmt: skip
            index[tensor] = replace(entry, start=data_start + begin, end=data_start + end)
    return index


def unmapped_tensors(index: Iterable[str]) -> list[str]:
    """The checkpoint's tensors our Transformer has no parameter for (biases, fused experts, ...)."""
    unknown = []
    for name in index:
        if name.endswith(_IGNORED):
            continue
        try:
            our_name(name)
        except UnknownName:
            unknown.append(name)
    return unknown
