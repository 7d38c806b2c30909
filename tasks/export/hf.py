"""Our checkpoints in the Hugging Face layout: config.json, weight names, safetensors shards, tokenizer files.

A dense SwiGLU model is a `LlamaForCausalLM`, an MoE one a `MixtralForCausalLM`: the same pre-norm blocks,
RMSNorm, rotary embeddings in the rotate-half layout (training/model.py `apply_rotary` is Llama's, so the
query and key weights need no permutation), grouped-query attention and SwiGLU experts. Mixtral's router is
ours too: softmax over the experts in fp32, top-k, the k weights renormalised to sum to one. Expert weights
take the per-expert names `block_sparse_moe.experts.<e>.w1/w2/w3` and `block_sparse_moe.gate`, which
transformers (5.x converts them to its fused tensors on load) and vLLM both read.

What the format cannot express is refused with the reason (`unexportable`): a GELU MLP. Dropout is a
training-time operation and has no weights: it is dropped. An MoE run trained with a capacity factor dropped
the assignments over an expert's capacity, in training and in its evaluations; Mixtral routes every token
(dropless), which is our model with `expert_capacity_factor: null`. The export goes ahead, since dropless is
what inference wants and no Hugging Face model drops tokens, and says so in its notes (`behaviour_notes`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from tasks.errors import UserError
from training import hf_names

if TYPE_CHECKING:
    import torch

    from training.checkpoint import CheckpointManager, ModelCard, TensorInfo
    from training.config import ModelConfig
    from training.storage import StorageConfig

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size before 5.0 ("5GB")
BYTE_EOS_TOKEN = "<|endoftext|>"  # the bytes tokenizer's EOS (id 256, tasks/prepare/tokenizer.py BYTE_EOS)
_BYTE_VOCAB = 256

class ExportError(UserError):
    """A checkpoint that cannot become a Hugging Face model folder; `field` and `value` name what is at fault."""

    def __init__(self, field: str, value: Any, problem: str, fix: str) -> None:
        super().__init__(f"{field}={value}: {problem}", fix)
        self.field, self.value, self.problem = field, value, problem


def unexportable(model: ModelConfig) -> list[ExportError]:
    """Every architecture choice the Llama / Mixtral formats cannot express ([] when the model exports)."""
    problems = []
    if model.mlp != "swiglu":
        problems.append(
            ExportError(
                "model.mlp",
                model.mlp,
                "the Llama and Mixtral MLP is SwiGLU, down(silu(gate x) * up x); a GELU MLP without the up "
                "projection has no equivalent in either, so its logits could not match",
                "export works for model.mlp: swiglu (train with it); keep this checkpoint for our own trainer",
            )
        )
    return problems


def behaviour_notes(card: ModelCard) -> list[str]:
    """Where the exported model computes something other than the run did (the training run's choices)."""
    if card.model.moe is not None and card.expert_capacity_factor is not None:
        return [
            f"trained with parallel.expert_capacity_factor={card.expert_capacity_factor}: assignments over an "
            "expert's capacity were dropped in training and in its evaluations; the exported Mixtral routes "
            "every token (dropless), like our model with expert_capacity_factor: null, so its loss can differ "
            "from the run's val_loss"
        ]
    return []


def hf_config(
    model: ModelConfig,
    eos_id: int | None = None,
    bos_id: int | None = None,
    pad_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """config.json of `model`: LlamaForCausalLM when dense, MixtralForCausalLM with MoE (ExportError if neither
    can express it). `dtype` goes into torch_dtype: the dtype loaders and servers take by default (the tensors
    themselves stay fp32, which loses nothing)."""
    problems = unexportable(model)
    if problems:
        raise problems[0]
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    config: dict[str, Any] = {
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_hidden,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": model.norm_eps,
        # transformers >= 5 reads rope_parameters (and Mixtral's default theta is 1e6, not ours); older readers
        # and vLLM's older versions read rope_theta.
        "rope_theta": model.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers >= 5 spells torch_dtype so
    }
    if model.moe is None:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config, "mlp_bias": False}
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **config,
        "num_local_experts": model.moe.n_experts,
        "num_experts_per_tok": model.moe.top_k,
        "router_aux_loss_coef": model.moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def hf_name(name: str, tied: bool = False) -> str | None:
    """The Hugging Face name of our parameter `name` (training/hf_names.py); None for lm_head.weight when tied to
    the embedding; ExportError for a name training/model.py does not have."""
    try:
        return hf_names.hf_name(name, tied)
    except hf_names.UnknownName as err:
        raise ExportError(
            "tensor",
            name,
            "is not a parameter of training/model.py's Transformer, so it has no Hugging Face name",
            "export a checkpoint this trainer saved (or add the name to training/hf_names.py _NAMES)",
        ) from err


def expected_tensors(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for `model` (tied weights once), from the model built on the meta device."""
    import torch

    from training.model import Transformer

    with torch.device("meta"):
        built = Transformer(model)
    return {name: tuple(param.shape) for name, param in built.named_parameters()}


@dataclass(frozen=True)
class WeightsWritten:
    """The safetensors files an export wrote."""

    files: list[str]
    n_params: int
    tensor_bytes: int


def plan_shards(
    tensors: dict[str, TensorInfo], model: ModelConfig, max_shard_bytes: int
) -> list[list[tuple[str, str, TensorInfo]]]:
    """The checkpoint's tensors as (our name, Hugging Face name, info), cut into files of at most
    `max_shard_bytes` (a larger tensor gets a file of its own); ExportError when the checkpoint does not hold
    exactly the parameters of `model`."""
    return plan_named_shards(
        tensors, expected_tensors(model), lambda name: hf_name(name, model.tie_embeddings),
        f"its model ({model.n_layers} layers)", max_shard_bytes,
    )  # fmt: skip


def plan_named_shards(
    tensors: dict[str, TensorInfo],
    expected: dict[str, tuple[int, ...]],
    their_name: Callable[[str], str | None],
    holder: str,
    max_shard_bytes: int,
) -> list[list[tuple[str, str, TensorInfo]]]:
    """(our name, their name, info) of the `expected` parameters (in the model's own order; `their_name` None:
    not written, a tied weight) cut into files of at most `max_shard_bytes`; ExportError naming `holder` when the
    checkpoint lacks one or holds one of another shape. Every exporter's planner (LM, ViT, LLaVA)."""
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ExportError(
            "checkpoint tensors",
            ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""),
            f"missing: the checkpoint does not hold every parameter of {holder}",
            "export a checkpoint saved by this trainer for this model (its model.json names the architecture)",
        )
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ExportError(
                f"checkpoint tensor {name}",
                list(tensors[name].shape),
                f"the model needs shape {list(shape)}",
                "export with the model config the checkpoint was trained with (its model.json)",
            )
    shards: list[list[tuple[str, str, TensorInfo]]] = [[]]
    size = 0
    for name in expected:  # the model's own order: embeddings, layer by layer, final norm, head
        theirs = their_name(name)
        if theirs is None:
            continue
        info = tensors[name]
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, theirs, info))
        size += info.nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    """The file name of shard `index` (0-based) of `count`, as transformers names them."""
    return WEIGHTS if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def export_model_weights(
    checkpoints: CheckpointManager,
    step: int,
    model: ModelConfig,
    out_dir: Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> WeightsWritten:
    """Write the model weights of checkpoint `step` into `out_dir` as safetensors (sharded above
    `max_shard_bytes`, with model.safetensors.index.json), one shard in memory at a time.

    The caller has checked the step with `checkpoints.sound(step)` (commit, signature, checksums); DCP's
    metadata is unpickled with the allow-list and tensors are read as plain data (training/checkpoint/trust.py).
    """
    from safetensors.torch import save_file

    shards = plan_shards(checkpoints.model_tensors(step), model, max_shard_bytes)
    files, weight_map, n_params, total = [], {}, 0, 0
    for index, shard in enumerate(shards):
        name = shard_name(index, len(shards))
        loaded = checkpoints.load_model_tensors(step, {ours: info for ours, _, info in shard})
        tensors: dict[str, torch.Tensor] = {theirs: loaded.pop(ours) for ours, theirs, _ in shard}
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        for theirs, tensor in tensors.items():
            weight_map[theirs] = name
            n_params += tensor.numel()
            total += tensor.numel() * tensor.element_size()
        files.append(name)
        del tensors, loaded
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index_doc, indent=2))
        files.append(WEIGHTS_INDEX)
    return WeightsWritten(files, n_params, total)


def byte_tokenizer_json() -> str:
    """tokenizer.json of our bytes tokenizer: id = UTF-8 byte value, EOS 256 "<|endoftext|>".

    A BPE without merges whose vocabulary holds only the byte tokens <0x00>..<0xFF>: every character falls
    back to its UTF-8 bytes (byte_fallback), so the ids are the byte values; no normalizer, no pre-tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{value:02X}>": value for value in range(_BYTE_VOCAB)}
    vocab[BYTE_EOS_TOKEN] = _BYTE_VOCAB
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
    probe = "byte ids: é 日 🎉\n"
    assert tokenizer.encode(probe).ids == list(probe.encode("utf-8")), "this tokenizers version changed byte_fallback"
    return tokenizer.to_str()


def _read_tokenizer(card: ModelCard, storage: StorageConfig) -> str:
    """The dataset's tokenizer.json the card names, checked against the card's sha256."""
    url = card.tokenizer.url
    if url is None:
        raise ExportError(
            "model.json tokenizer.url",
            None,
            "a bpe tokenizer without the location of its tokenizer.json",
            "the dataset's manifest must name its tokenizer.json (tokenizer.path): rebuild it with tdeploy "
            "prepare-data",
        )
    try:
        with fsspec.open(url, "rb", **storage.fsspec_options(url)) as handle:
            raw = handle.read()
    except FileNotFoundError as err:
        raise ExportError(
            "tokenizer", url, "no such file (the checkpoint's model.json names it)", "restore the dataset there"
        ) from err
    digest = hashlib.sha256(raw).hexdigest()
    if card.tokenizer.sha256 is not None and digest != card.tokenizer.sha256:
        raise ExportError(
            "tokenizer",
            url,
            f"has sha256 {digest}, the checkpoint was trained with {card.tokenizer.sha256}",
            "the dataset was rebuilt with another tokenizer since: restore the one the run used",
        )
    return raw.decode("utf-8")


def pad_token(tokenizer_json: str, eos_token: str | None) -> str | None:
    """The pad token to declare: the one tokenizer.json pads with, else `eos_token` (None when neither exists)."""
    padding = json.loads(tokenizer_json).get("padding") or {}
    return padding.get("pad_token") or eos_token


def write_tokenizer(card: ModelCard, storage: StorageConfig, out_dir: Path) -> list[str]:
    """tokenizer.json and tokenizer_config.json (a PreTrainedTokenizerFast) of the run's tokenizer; the files."""
    from tokenizers import Tokenizer

    extra: dict[str, Any] = {}
    if card.tokenizer.kind == "bytes":
        text, eos_token = byte_tokenizer_json(), BYTE_EOS_TOKEN
        # Ours encodes the text "<|endoftext|>" as its bytes: so must the fast tokenizer.
        extra["split_special_tokens"] = True
    else:
        text = _read_tokenizer(card, storage)
        eos_token = Tokenizer.from_str(text).id_to_token(card.eos_id) if card.eos_id is not None else None
    (out_dir / TOKENIZER).write_text(text)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        # batched tokenisation with padding needs a pad token: the tokenizer's own, else EOS (ours have none);
        # left padding, since a batch is padded for generation (transformers warns on right-padded generate)
        "pad_token": pad_token(text, eos_token),
        "padding_side": "left",
        "model_max_length": card.model.seq_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **extra,
    }
    (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2))
    return [TOKENIZER, TOKENIZER_CONFIG]


def write_configs(card: ModelCard, out_dir: Path, dtype: str = "float32") -> list[str]:
    """config.json (`dtype`: the dtype to serve in, the run's precision) and generation_config.json (greedy, stop
    and pad at EOS); the files.

    Our documents carry no BOS: each follows the previous one's EOS in the training stream, so EOS is also the
    id to start from (bos_token_id = eos_id, as GPT-2 does); the tokenizer adds nothing.
    """
    config = hf_config(card.model, eos_id=card.eos_id, bos_id=card.eos_id, pad_id=card.eos_id, dtype=dtype)
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2))
    # No max_length: a fixed one conflicts with every caller's max_new_tokens (transformers warns when both are
    # set); the context limit is config.json's max_position_embeddings.
    generation = {
        "bos_token_id": card.eos_id,
        "eos_token_id": card.eos_id,
        "pad_token_id": card.eos_id,
        "do_sample": False,
    }
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))
    return [CONFIG, GENERATION_CONFIG]
